"""The MoE layer's backward (commweave.ops.moe_layer / commweave.nn.ExpertParallelMoE with inputs
that require grad): on CPU over gloo at W = 2 and 4, the output and all four gradients (x,
topk_weights, w13, w2) against one float32 single-process autograd computation; torch.compile
(fullgraph=True) forward + backward at W = 2; at W = 1 in this process the same, the custom ops'
registrations (opcheck), and the errors. GPU (1 GPU): the same at W = 1 on CUDA. Jobs: moe_jobs.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import commweave.ops as ops
from commweave.nn import ExpertParallelMoE
from commweave.runtime import WorkerPool
from moe_jobs import HIDDEN, INTER, moe_data, reference

#: bf16 activations and weights against float32 math: a few 1e-3 measured; a gradient routed to
#: the wrong token, expert or rank is off by tens of percent
TOLERANCE = 2e-2
GRADS = {"out", "x", "topk_weights", "w13", "w2"}


def _check(values: list[dict], key: str = "errors") -> None:
    for rank, value in enumerate(values):
        assert set(value[key]) == GRADS, value
        for what, error in value[key].items():
            assert error <= TOLERANCE, f"rank {rank}: {key} {what} {error:.3g}"


@pytest.fixture(scope="module", params=[2, 4])
def pool(request):
    with WorkerPool(request.param, device="cpu", job_timeout_s=300) as pool:
        yield pool


def test_moe_training_matches_one_float32_autograd(pool: WorkerPool) -> None:
    result = pool.run("moe_jobs:moe_training", experts=8)
    assert result.ok, result.first_failure()
    _check(result.values)
    for value in result.values:
        assert value["dtypes"] == {"out": "torch.bfloat16", "x": "torch.bfloat16", "topk_weights": "torch.float32",
                                   "w13": "torch.bfloat16", "w2": "torch.bfloat16"}, value


@pytest.mark.parametrize("compiler,close", [("aot_eager", 1e-6), ("inductor", 1e-2)])
def test_moe_training_compiles_fullgraph(pool: WorkerPool, compiler: str, close: float) -> None:
    """aot_eager: dynamo's and AOTAutograd's graphs run as traced, eager's numbers; inductor also
    generates the glue's kernels (the routing weights' products), so it may round differently."""
    if pool.world_size != 2:
        pytest.skip("compiled at W = 2 only: compiling costs CPU time")
    result = pool.run("moe_jobs:moe_training", experts=8, compiled=True, compiler=compiler)
    assert result.ok, result.first_failure()
    _check(result.values, "compiled_errors")
    for rank, value in enumerate(result.values):
        assert value["graphs"] == [["commweave.moe_layer_train"]], value
        for what, diff in value["compiled_vs_eager"].items():
            assert diff <= close, f"rank {rank}: compiled {what} differs from eager by {diff:.3g}"


# -- one process (W = 1) --------------------------------------------------------------------------------
def _one_rank(device: str) -> dict[str, float]:
    data = moe_data(1, experts=6)
    want = reference(data)
    layer = ExpertParallelMoE(HIDDEN, INTER, 6, device=device)
    layer.load_full(data["w13"].to(device), data["w2"].to(device))
    x = data["x"][0].to(device).requires_grad_()
    w = data["topk_weights"][0].to(device).requires_grad_()
    out = layer(x, data["topk_idx"][0].to(device), w)
    (out.float() * data["grad"][0].to(device).float()).sum().backward()
    got = {"out": out.detach(), "x": x.grad, "topk_weights": w.grad, "w13": layer.w13.grad, "w2": layer.w2.grad}
    want = {k: v[0] if k in ("out", "x", "topk_weights") else v for k, v in want.items()}  # rank 0 of 1
    return {k: float((got[k].cpu().float() - want[k]).norm() / want[k].norm()) for k in got}


@pytest.mark.skipif(dist.is_initialized(), reason="runs without a process group")
def test_moe_training_on_one_rank() -> None:
    errors = _one_rank("cpu")
    assert set(errors) == GRADS and all(e <= TOLERANCE for e in errors.values()), errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs 1 GPU")
def test_moe_training_on_one_gpu() -> None:
    """1 GPU: the training path's grouped GEMMs on CUDA (cuBLAS/CUTLASS grouped kernels)."""
    errors = _one_rank("cuda")
    assert set(errors) == GRADS and all(e <= TOLERANCE for e in errors.values()), errors


def _train_args() -> tuple:
    data = moe_data(1, experts=4)
    return (data["x"][0], data["topk_idx"][0], data["topk_weights"][0], data["w13"], data["w2"], "")


@pytest.mark.skipif(dist.is_initialized(), reason="runs without a process group")
def test_opcheck_training_ops() -> None:
    """Schemas, fakes, autograd registration (with inputs that require grad) and dispatch."""
    x, idx, w, w13, w2, group = _train_args()
    torch.library.opcheck(torch.ops.commweave.moe_layer_train.default,
                          (x.requires_grad_(), idx, w.requires_grad_(), w13.requires_grad_(), w2.requires_grad_(), group))
    x, idx, w, w13, w2, group = _train_args()  # no double backward: the backward's inputs need no grad
    out, *saved = torch.ops.commweave.moe_layer_train(x, idx, w, w13, w2, group)
    torch.library.opcheck(torch.ops.commweave.moe_layer_backward.default,
                          (torch.randn_like(out), idx, w, w13, w2, *saved, group))


@pytest.mark.skipif(dist.is_initialized(), reason="runs without a process group")
def test_moe_training_errors() -> None:
    x, idx, w, w13, w2, _ = _train_args()
    with pytest.raises(ValueError, match="program 'seed' runs moe_layer's forward only"):
        ops.moe_layer(x, idx, w.requires_grad_(), w13, w2, program="seed")
    with pytest.raises(ValueError, match=r"x \[T, H\], w13 \[E, 2I, H\] and w2 \[E, H, I\] expected"):
        ops.moe_layer(x, idx, w, w13, w2[:, :, :4])
    with pytest.raises(RuntimeError, match="torch.ops.commweave.moe_layer is forward-only"):
        torch.ops.commweave.moe_layer(x, idx, w, w13, w2, "", None).float().sum().backward()
    with pytest.raises(ValueError, match="experts must be positive, not 0"):
        ExpertParallelMoE(HIDDEN, INTER, 0)
    layer = ExpertParallelMoE(HIDDEN, INTER, 4)
    with pytest.raises(ValueError, match=r"full weights are w13 \[4, 32, 32\] and w2 \[4, 32, 16\]"):
        layer.load_full(w13[:2], w2)


@pytest.mark.skipif(dist.is_initialized(), reason="runs without a process group")
def test_one_rank_does_the_work_of_a_local_moe() -> None:
    """At W = 1, forward + backward: the same grouped GEMMs as a plain local MoE under torch
    autograd (the workload's single_rank: sort, gather, grouped GEMMs, weighted sum) and no more
    copying (the CPU profiler records every aten op, nested ones included, with its shapes)."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    from commweave.workloads import get_workload

    x, idx, w, w13, w2, _ = _train_args()
    grad = torch.randn_like(x)
    layer = ExpertParallelMoE(HIDDEN, INTER, 4)
    layer.load_full(w13, w2)
    leaves = [t.clone().requires_grad_() for t in (x, w, w13, w2)]
    local = get_workload("moe").single_rank

    def work(step) -> Counter:
        """aten ops by name, and "copied": the elements every aten::copy_ wrote."""
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            step()
        counts = Counter(e.name for e in prof.events())
        counts["copied"] = sum(math.prod(e.input_shapes[0]) for e in prof.events() if e.name == "aten::copy_")
        return counts

    def ours() -> None:
        layer(leaves[0], idx, leaves[1]).backward(grad)

    def plain() -> None:
        local(dict(zip(("x", "topk_idx", "topk_weights", "w13", "w2"), (leaves[0], idx, *leaves[1:])))).backward(grad)

    mine, theirs = work(ours), work(plain)
    assert mine["aten::_grouped_mm"] == theirs["aten::_grouped_mm"] == 6, (mine, theirs)
    # CPU elementwise ops copy a bf16 operand to fp32 before a mixed-dtype product (CUDA casts
    # inside the kernel): the weights' gradient's product with the bf16 pair outputs costs one
    # [T, K, H] copy here that autograd avoids by keeping an fp32 copy of them from forward
    assert 0 < mine["copied"] <= theirs["copied"] + x.shape[0] * idx.shape[1] * x.shape[1], (mine, theirs)
    assert mine["aten::mm"] == theirs["aten::mm"]  # the CPU grouped GEMM: one GEMM per group


def test_train_yardstick_runs_a_training_step(pool: WorkerPool) -> None:
    """`commweave bench moe` times the `train_host` yardstick beside the forward: the host
    program with CONFIG train=True runs forward + backward and still writes the forward's output."""
    result = pool.run("moe_jobs:train_yardstick")
    assert result.ok, result.first_failure()
    for value in result.values:
        assert value["error"] <= TOLERANCE, value
