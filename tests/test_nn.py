"""commweave.nn on CPU over gloo: a Megatron-style MLP block (column- then row-parallel, built
from commweave's ops) against one plain float32 MLP, in forward output and every gradient; at
W = 4 with two kinds of groups in one program (TP pairs {0,1}, {2,3} and DP groups {0,2}, {1,3}
with a gradient all-reduce); and under torch.compile(fullgraph=True). The jobs live in ops_jobs.py."""

from __future__ import annotations

import pytest
import torch

from commweave.nn import ColumnParallelLinear, RowParallelLinear
from commweave.runtime import WorkerPool
from commweave.workloads import registry

#: bf16 weights and activations against float32 math: a few 1e-3 measured; a wrong shard or a
#: missing reduction is off by tens of percent
TOLERANCE = 2e-2


@pytest.fixture(scope="module", params=[2, 4])
def pool(request):
    with WorkerPool(request.param, device="cpu", job_timeout_s=300) as pool:
        yield pool


def _check(values: list[dict], key: str = "errors") -> None:
    for rank, value in enumerate(values):
        for what, error in value[key].items():
            assert error <= TOLERANCE, f"rank {rank}: {key} {what} {error:.3g}"


def test_tp_mlp_matches_one_plain_mlp(pool: WorkerPool) -> None:
    tp = 2  # W = 2: one TP pair; W = 4: two TP pairs and two DP groups
    result = pool.run("ops_jobs:tp_mlp", tp=tp)
    assert result.ok, result.first_failure()
    _check(result.values)
    rs_fallback = "gemm-reducescatter" not in registry()
    for value in result.values:
        assert value["shapes"] == {"y": (4, 16), "x_grad": (4, 16), "up_grad": (16, 16), "down_grad": (16, 16)}, value
        said = [w for w in value["warnings"] if "no workload 'gemm-reducescatter' is registered" in w]
        assert len(said) == int(rs_fallback), value["warnings"]


def test_tp_mlp_whole_world_tp(pool: WorkerPool) -> None:
    result = pool.run("ops_jobs:tp_mlp", tp=pool.world_size)
    assert result.ok, result.first_failure()
    _check(result.values)


@pytest.mark.parametrize("compiler,close", [("aot_eager", 1e-6), ("inductor", 1e-2)])
def test_tp_mlp_compiles_fullgraph_and_matches_eager(pool: WorkerPool, compiler: str, close: float) -> None:
    """aot_eager: dynamo's graph and AOTAutograd's joint graph run as traced, bit for bit eager's;
    inductor (W = 2 only: compiling costs CPU time) also generates the glue's kernels."""
    if compiler == "inductor" and pool.world_size != 2:
        pytest.skip("inductor is compiled at W = 2 only")
    result = pool.run("ops_jobs:tp_mlp", tp=2, compiled=True, compiler=compiler)
    assert result.ok, result.first_failure()
    _check(result.values, "compiled_errors")
    for rank, value in enumerate(result.values):
        assert value["graphs"] == [["commweave.gemm_allgather", "commweave.gemm_reducescatter"]], value
        for what, diff in value["compiled_vs_eager"].items():
            assert diff <= close, f"rank {rank}: compiled {what} differs from eager by {diff:.3g}"


# -- one process: the layers at W = 1 --------------------------------------------------------------
def test_layers_on_one_rank_are_plain_linears() -> None:
    torch.manual_seed(0)
    up, down = ColumnParallelLinear(16, 32, dtype=torch.float32), RowParallelLinear(32, 16, dtype=torch.float32)
    x = torch.randn(8, 16, requires_grad=True)
    y = down(torch.nn.functional.gelu(up(x)))
    xr = x.detach().clone().requires_grad_()
    yr = torch.nn.functional.gelu(xr @ up.weight.detach().t()) @ down.weight.detach().t()
    torch.testing.assert_close(y, yr)
    y.sum().backward()
    yr.sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    assert up.weight.grad.shape == (32, 16) and down.weight.grad.shape == (16, 32)


def test_layer_errors() -> None:
    with pytest.raises(ValueError, match="group must be None, a ProcessGroup, a DeviceMesh"):
        ColumnParallelLinear(4, 4, group=3)
    layer = RowParallelLinear(8, 4)
    with pytest.raises(ValueError, match=r"a full weight is \[4, 8\], got \(8, 4\)"):
        layer.load_full(torch.zeros(8, 4))


# -- no tax at W = 1: the same aten work as torch.nn.Linear, forward and backward ----------------------
_COUNTED = ("aten::mm", "aten::addmm", "aten::bmm", "aten::copy_", "aten::clone", "aten::contiguous")


def _work(step) -> dict[str, int]:
    """GEMMs and copies (aten ops the CPU profiler records, nested ones included) of one step."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return dict(Counter(e.name for e in prof.events() if e.name in _COUNTED))


@pytest.mark.parametrize("path", ["layers", "ops"])
def test_tp_mlp_on_one_rank_does_what_nn_linear_does(path: str) -> None:
    """The TP MLP block at TP = 1, forward + backward from fresh gradients (autograd's first
    accumulation, where a gradient in the wrong layout is copied into the weight's), against the
    same block of nn.Linear: the same GEMMs and no copy. `ops`: the custom ops themselves on the
    layers' weight.t(), as the layers call them on several ranks."""
    torch.manual_seed(0)
    up, down = ColumnParallelLinear(16, 48), RowParallelLinear(48, 16)
    plain_up, plain_down = (torch.nn.Linear(i, o, bias=False, dtype=torch.bfloat16) for i, o in ((16, 48), (48, 16)))
    x = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(8, 16, dtype=torch.bfloat16)
    if path == "layers":
        ours = lambda: down(torch.nn.functional.gelu(up(x)))  # noqa: E731
    else:
        ours = lambda: torch.ops.commweave.gemm_reducescatter(  # noqa: E731
            torch.nn.functional.gelu(torch.ops.commweave.gemm_allgather(x, up.weight.t(), "", None)),
            down.weight.t(), "", None)

    def step(forward, params) -> None:
        for p in (*params, x):
            p.grad = None
        forward().backward(grad)

    mine = _work(lambda: step(ours, [up.weight, down.weight]))
    theirs = _work(lambda: step(lambda: plain_down(torch.nn.functional.gelu(plain_up(x))),
                                [plain_up.weight, plain_down.weight]))
    assert theirs == {"aten::mm": 6}, theirs  # 2 forward, 4 backward GEMMs, no copy
    assert mine == theirs
    assert up.weight.grad.is_contiguous() and down.weight.grad.is_contiguous()
