"""Context-parallel attention with a backward: the block backward and the ring (forward with LSE,
backward with dK/dV travelling home) against float32 autograd, in one process; then
`ContextParallelAttention` and `ops.context_parallel_attention` trained over CPU gloo groups of 2
and 4 ranks (full and causal, both layouts, GQA, a batch of 2), and under torch.compile(fullgraph).
The W >= 2 jobs live in attention_train_jobs.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import commweave.ops as ops
from attention_train_jobs import full_data, reference
from commweave.nn import ContextParallelAttention
from commweave.runtime import WorkerPool
from commweave.workloads.attention_cp.attention import attention_backward_block
from commweave.workloads.attention_cp.ring import ring_backward, ring_forward

#: bf16 inputs and outputs against float32 math: a few 1e-3 measured; a lost block or a gradient
#: left on the wrong rank is off by tens of percent
TOLERANCE = 2e-2


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


# -- one process --------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_block_backward_sums_to_the_whole(causal: bool) -> None:
    """Key blocks' gradients from the global out and LSE add up to the whole attention's, and the
    query tiling (q_block 5 of 12 rows) changes nothing."""
    q, k, v, g = full_data(1, 12, 4, 2, 8)
    want = reference(q, k, v, g, causal)
    out, lse = ring_forward(q, k, v, causal, False, None)
    dq, dk, dv = attention_backward_block(g[0], q[0], k[0], v[0], out[0], lse[0], causal=causal, q_block=5)
    for got, name in ((dq, "dq"), (dk, "dk"), (dv, "dv")):
        assert _rel(got, want[name][0]) < TOLERANCE, name
    if not causal:  # two key blocks of 6: their gradients sum to the whole one's
        a = attention_backward_block(g[0], q[0], k[0, :6], v[0, :6], out[0], lse[0])
        b = attention_backward_block(g[0], q[0], k[0, 6:], v[0, 6:], out[0], lse[0])
        torch.testing.assert_close(a[0] + b[0], dq, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.cat([a[1], b[1]]), dk, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_ring_on_one_rank_matches_autograd(causal: bool) -> None:
    q, k, v, g = full_data(2, 16, 4, 2, 8)
    want = reference(q, k, v, g, causal)
    out, lse = ring_forward(q, k, v, causal, causal, None)
    dq, dk, dv = ring_backward(g, q, k, v, out, lse, causal, causal, None)
    assert out.dtype == torch.bfloat16 and lse.shape == (2, 16, 4) and dq.dtype == torch.float32
    for got, name in ((out, "out"), (dq, "dq"), (dk, "dk"), (dv, "dv")):
        assert _rel(got, want[name]) < TOLERANCE, name


def test_lse_op_passes_opcheck() -> None:
    """Schema, fake, autograd registration (inputs requiring grad) and dispatch of both new ops."""
    q, k, v, g = full_data(2, 8, 4, 2, 8)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.commweave.context_parallel_attention_lse.default, (q, k, v, True, True, ""))
    out, lse = torch.ops.commweave.context_parallel_attention_lse(q.detach(), k.detach(), v.detach(), True, True, "")
    torch.library.opcheck(torch.ops.commweave.context_parallel_attention_backward.default,
                          (g.bfloat16(), q.detach(), k.detach(), v.detach(), out, lse, True, True, ""))


@pytest.mark.parametrize("causal", [False, True])
def test_one_process_is_sdpa(causal: bool) -> None:
    """No group: the function and the module are SDPA on [B, H, S, D] views (its own autograd, no
    commweave op), 3-D inputs a batch of one."""
    q, k, v, g = full_data(2, 16, 4, 2, 8)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                          enable_gqa=True).transpose(1, 2)
    assert torch.equal(ops.context_parallel_attention(q, k, v, causal=causal), want)
    assert torch.equal(ContextParallelAttention(causal=causal)(q, k, v), want)
    assert torch.equal(ops.context_parallel_attention(q[0], k[0], v[0], causal=causal), want[0])
    qg = q.clone().requires_grad_()
    out = ContextParallelAttention(causal=causal)(qg, k, v)
    assert out.grad_fn is not None and "commweave" not in type(out.grad_fn).__name__.lower()


def test_bad_attention_calls_say_what_is_wrong() -> None:
    q, k, v, _ = full_data(1, 8, 4, 2, 8)
    with pytest.raises(ValueError, match="layout must be 'contiguous' or 'zigzag', not 'ring'"):
        ContextParallelAttention(causal=True, layout="ring")
    with pytest.raises(ValueError, match="causal must be True or False, not 1"):
        ContextParallelAttention(causal=1)
    with pytest.raises(ValueError, match=r"q, k, v must all be \[B, S/W, H, D\] or all \[S/W, H, D\]"):
        ops.context_parallel_attention(q, k[0], v[0])
    with pytest.raises(ValueError, match="4 query heads are not a multiple of 3 KV heads"):
        ops.context_parallel_attention(q, k[..., :1, :].expand(1, 8, 3, 8), v[..., :1, :].expand(1, 8, 3, 8))
    with pytest.raises(ValueError, match="must share batch, tokens and head dim"):
        ring_forward(q, k[:, :4], v[:, :4], False, False, None)


# -- gloo groups of 2 and 4 ---------------------------------------------------------------------
@pytest.fixture(scope="module", params=[2, 4])
def pool(request):
    with WorkerPool(request.param, device="cpu", job_timeout_s=300) as pool:
        yield pool


def _check(values: list[dict], key: str = "errors") -> None:
    for rank, value in enumerate(values):
        for what, error in value[key].items():
            assert error <= TOLERANCE, f"rank {rank}: {key} {what} {error:.3g}"


@pytest.mark.parametrize("causal,layout", [(False, "contiguous"), (True, "zigzag"), (True, "contiguous"),
                                           (False, "zigzag")])
def test_training_step_matches_one_process(pool: WorkerPool, causal: bool, layout: str) -> None:
    """out, dq, dk, dv of every rank's shard: batch 2, 16 tokens a rank (zigzag chunks of 8 at W = 2,
    4 at W = 4), 4 query heads over 2 KV heads, head dim 16."""
    seq = 16 * pool.world_size
    result = pool.run("attention_train_jobs:cp_training", batch=2, seq=seq, hq=4, hkv=2, dim=16, causal=causal,
                      layout=layout)
    assert result.ok, result.first_failure()
    _check(result.values)
    for value in result.values:
        assert value["dtypes"] == ["torch.bfloat16"]
        assert value["shapes"] == {"out": (2, 16, 4, 16), "dq": (2, 16, 4, 16), "dk": (2, 16, 2, 16),
                                   "dv": (2, 16, 2, 16)}


def test_function_trains_like_the_module(pool: WorkerPool) -> None:
    result = pool.run("attention_train_jobs:cp_training", batch=1, seq=8 * pool.world_size, hq=2, hkv=1, dim=8,
                      causal=True, layout="zigzag", functional=True)
    assert result.ok, result.first_failure()
    _check(result.values)


def test_training_step_compiles_fullgraph(pool: WorkerPool) -> None:
    if pool.world_size != 2:
        pytest.skip("compiled once, at W = 2")
    result = pool.run("attention_train_jobs:cp_training", batch=2, seq=32, hq=4, hkv=2, dim=16, causal=True,
                      layout="zigzag", compiled=True)
    assert result.ok, result.first_failure()
    _check(result.values)
    _check(result.values, "compiled_errors")
    for value in result.values:
        assert value["graphs"] == [["commweave.context_parallel_attention_lse"]], value["graphs"]
        assert max(value["compiled_vs_eager"].values()) < 1e-6, value["compiled_vs_eager"]


def test_training_step_timings(pool: WorkerPool) -> None:
    """`commweave bench`'s training-step job: every timing positive on every rank, the step's FLOPs
    3.5x the forward's; the table's row takes the slowest rank and, on GPUs, the floor."""
    from commweave.ops.train_bench import attention_step_times
    from commweave.report.train import train_rows
    from commweave.workloads import get_workload

    if pool.world_size != 2:
        pytest.skip("timed once, at W = 2")
    label = "s64-q4kv2-d16-causal"
    result = pool.run(attention_step_times, shape_text=label, iters=2, warmup=1)
    assert result.ok, result.first_failure()
    wl = get_workload("attention-cp")
    flops = wl.ideal_flops(wl.parse_shape(label, 2), 2, 0)
    for value in result.values:
        assert set(value) == {"forward", "ring_forward", "train", "train_flops"}, "no torch_cp step on CPU"
        assert min(value.values()) > 0 and value["train_flops"] == 3.5 * flops
    ranks = [{"forward": 1.0, "ring_forward": 2.0, "train": 5.0, "train_flops": 7.9e12},
             {"forward": 3.0, "ring_forward": 1.0, "train": 4.0, "train_flops": 7.9e12}]
    row = train_rows({label: ranks}, on_gpus=True)[0]
    assert row == {"shape": label, "forward": 3.0, "ring_forward": 2.0, "train": 5.0,
                   "train_floor": pytest.approx(10.0), "train_over_floor": pytest.approx(0.5)}
    assert train_rows({label: ranks}, on_gpus=False)[0]["train_floor"] is None


def test_the_forward_only_op_points_to_the_differentiable_one() -> None:
    q, k, v, _ = full_data(1, 8, 4, 2, 8)
    out = torch.ops.commweave.context_parallel_attention(q[0].requires_grad_(), k[0], v[0], True, "", None)
    with pytest.raises(RuntimeError, match="train through commweave.ops.context_parallel_attention or "
                                           "commweave.nn.ContextParallelAttention"):
        out.sum().backward()
    with pytest.raises(ValueError, match="neither a program of attention-cp"):
        ops.context_parallel_attention(q, k, v, causal=True, program="no_such_program")
