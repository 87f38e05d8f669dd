"""commweave.ops on GPUs through their torch.library custom ops (`-m gpu`).

One GPU, no process group (W = 1: every op computes locally): each op eager, under
torch.compile(fullgraph=True), and inside a caller's CUDA graph capture replayed on new input
values, each against an independent reference. Two GPUs (gloo-free: NCCL workers): gemm_allgather's
seed inside a caller's capture (after the first call of the shape, which must come before capture
and otherwise raises), over the default group and over a group made with new_group; the TP MLP of
commweave.nn against one float32 MLP on 2 GPUs and, with TP pairs beside DP groups, on 4.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import commweave.ops as ops
from commweave.runtime import WorkerPool
from commweave.workloads import get_workload
from commweave.workloads.attention_cp.attention import attention_with_lse

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count()
one_gpu = pytest.mark.skipif(GPUS < 1 or dist.is_initialized(), reason="needs 1 CUDA GPU (and no process group)")
TOLERANCE = 2e-2  # bf16 results against float32 references


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _draw(seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Every op's inputs on one rank, a function of `seed`."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*dims: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen, device=device) * scale).bfloat16()

    experts, top_k, tokens = 8, 2, 64
    idx = torch.rand(tokens, experts, generator=gen, device=device).argsort(dim=1)[:, :top_k].contiguous()
    return {
        "a": randn(256, 128), "b": randn(128, 96, scale=0.1),
        "q": randn(512, 8, 64), "k": randn(512, 2, 64), "v": randn(512, 2, 64),
        "x": randn(tokens, 128), "topk_idx": idx, "topk_weights": torch.rand(tokens, top_k, generator=gen, device=device),
        "w13": randn(experts, 2 * 64, 128, scale=0.1), "w2": randn(experts, 128, 64, scale=0.1),
        "kv": randn(2, 2, 40, 2, 128), "src_blocks": torch.tensor([4, 0, 2], device=device),
        "dst_blocks": torch.tensor([1, 5, 3], device=device),
    }


def _model(t: dict[str, torch.Tensor], cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every op once (the kv cache written in place)."""
    y = ops.gemm_reducescatter(ops.gemm_allgather(t["a"], t["b"]), t["b"].t())
    attn = ops.context_parallel_attention(t["q"], t["k"], t["v"], causal=True)
    moe = ops.moe_layer(t["x"], t["topk_idx"], t["topk_weights"], t["w13"], t["w2"])
    ops.transfer_kv(t["kv"], t["src_blocks"], t["dst_blocks"], cache)
    generic = ops.op("gemm-allgather")(a=t["a"], b=t["b"])
    return y, attn, moe, generic


def _references(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The same in float32 on the CPU, computed independently of the ops."""
    c = {k: v.cpu() for k, v in t.items()}
    a, b = c["a"].float(), c["b"].float()
    attn, _ = attention_with_lse(c["q"], c["k"], c["v"], causal=True, backend="torch")
    x, w13, w2 = c["x"].float(), c["w13"].float(), c["w2"].float()
    moe = torch.zeros_like(x)
    for tok in range(x.shape[0]):
        for slot, e in enumerate(c["topk_idx"][tok].tolist()):
            gate_up = w13[e] @ x[tok]
            moe[tok] += c["topk_weights"][tok, slot] * (w2[e] @ (F.silu(gate_up[:64]) * gate_up[64:]))
    return (a @ b) @ b.t(), attn, moe, a @ b


def _check(outs: tuple[torch.Tensor, ...], cache: torch.Tensor, t: dict[str, torch.Tensor], what: str) -> None:
    for name, got, want in zip(("gemm pair", "attention", "moe", "generic op"), outs, _references(t)):
        assert _rel(got.cpu(), want) <= TOLERANCE, f"{what}: {name} error {_rel(got.cpu(), want):.3g}"
    pages = torch.zeros(2, 2, 48, 2, 128, dtype=torch.bfloat16)
    pages[:, :, :40] = t["kv"].cpu()
    pages = pages.view(2, 2, 3, 16, 2, 128)
    for i, (s, d) in enumerate(zip(t["src_blocks"].tolist(), t["dst_blocks"].tolist())):
        assert torch.equal(cache[:, :, s].cpu(), pages[:, :, i]) and torch.equal(cache[:, :, d].cpu(), pages[:, :, i]), what


@one_gpu
def test_every_op_on_one_gpu_eager_compiled_and_in_a_callers_cuda_graph() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    cache = torch.zeros(2, 2, 6, 16, 2, 128, dtype=torch.bfloat16, device=device)
    inputs = _draw(1, device)
    _check(_model(inputs, cache), cache, inputs, "eager")

    torch._dynamo.reset()
    compiled = torch.compile(_model, fullgraph=True)
    cache.zero_()
    _check(compiled(inputs, cache), cache, inputs, "torch.compile")

    static = _draw(2, device)  # the caller's static buffers
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph's docs ask
        _model(static, cache)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _model(static, cache)
    for seed in (3, 4, 5):  # new values in the same buffers: the replay computes on them
        fresh = _draw(seed, device)
        for name, tensor in static.items():
            tensor.copy_(fresh[name])
        cache.zero_()
        graph.replay()
        torch.cuda.synchronize()
        _check(outs, cache, fresh, f"replay with seed {seed}")


@one_gpu
def test_a_programs_graph_cache_records_into_the_callers_capture() -> None:
    """The seeds' CallGraphs: under a caller's capture it neither captures (captures cannot nest)
    nor replays, it issues the call, so the caller's graph holds it and recomputes on new values."""
    from commweave.runtime.graphs import CallGraphs

    graphs = CallGraphs()
    x = torch.arange(8.0, device="cuda")
    y = torch.empty_like(x)

    def call() -> None:
        torch.mul(x, 2.0, out=y)

    graphs(call, [x, y])  # the program's first call: eager
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graphs(call, [x, y])  # its own capture and replay, outside any caller's
    torch.cuda.current_stream().wait_stream(side)
    assert len(graphs) == 1
    caller = torch.cuda.CUDAGraph()
    with torch.cuda.graph(caller):
        graphs(call, [x, y])
    assert len(graphs) == 1, "no capture of its own inside the caller's"
    for scale in (3.0, 5.0):
        x.copy_(torch.arange(8.0, device="cuda") * scale)
        caller.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, x * 2.0)


# -- several GPUs: the seed inside a caller's capture; the TP MLP -----------------------------------
@pytest.fixture(scope="module")
def pool2():
    with WorkerPool(2, device="cuda", job_timeout_s=300) as pool:
        yield pool


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("subgroup", [False, True])
def test_gemm_allgather_seed_in_a_callers_cuda_graph(pool2: WorkerPool, subgroup: bool) -> None:
    wl = get_workload("gemm-allgather")
    result = pool2.run("ops_jobs:gemm_in_captured_graph", shape_text="1024x1024x512", seed=11, subgroup=subgroup)
    assert result.ok, result.first_failure()
    for value in result.values:
        assert "call the op once with these shapes before capturing" in value["first_under_capture"], value
        assert value["program"] == "seed" and value["replays"] == 3, value
        assert value["error"] <= wl.tolerance(), value


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")
def test_tp_mlp_on_two_gpus(pool2: WorkerPool) -> None:
    result = pool2.run("ops_jobs:tp_mlp", tp=2, compiled=True)
    assert result.ok, result.first_failure()
    for rank, value in enumerate(result.values):
        for key in ("errors", "compiled_errors"):
            for what, error in value[key].items():
                assert error <= TOLERANCE, f"rank {rank}: {key} {what} {error:.3g}"


@pytest.mark.skipif(GPUS < 4, reason="needs 4 CUDA GPUs")
def test_tp_pairs_beside_dp_groups_on_four_gpus() -> None:
    with WorkerPool(4, device="cuda", job_timeout_s=300) as pool:
        result = pool.run("ops_jobs:tp_mlp", tp=2)
    assert result.ok, result.first_failure()
    for rank, value in enumerate(result.values):
        for what, error in value["errors"].items():
            assert error <= TOLERANCE, f"rank {rank}: {what} {error:.3g}"
