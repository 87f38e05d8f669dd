"""commweave.ops as torch.library custom ops, in this process (no process group: W = 1, every op
computed locally with no communication): schemas, fake implementations and autograd registrations
(`torch.library.opcheck`), shape propagation under FakeTensorMode, torch.compile(fullgraph=True),
the single-rank results against independent references, the group argument, and clear errors
for inputs that need a gradient an op does not have. W >= 2 fakes run in gloo workers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import commweave.ops as ops
from commweave.ops.groups import SINGLE, group_name
from commweave.runtime import WorkerPool
from commweave.workloads.attention_cp.attention import attention_with_lse

pytestmark = pytest.mark.skipif(dist.is_initialized(), reason="these tests run without a process group")


def _bf16(*dims: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*dims) * scale).bfloat16()


def _moe_inputs(tokens: int = 6, hidden: int = 16, inter: int = 8, experts: int = 4, top_k: int = 2) -> dict:
    gen = torch.Generator().manual_seed(5)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    return {"x": _bf16(tokens, hidden), "topk_idx": idx, "topk_weights": torch.rand(tokens, top_k),
            "w13": _bf16(experts, 2 * inter, hidden, scale=0.25), "w2": _bf16(experts, hidden, inter, scale=0.25)}


def _kv_inputs() -> tuple:
    kv = _bf16(2, 2, 20, 1, 128)  # 20 tokens: 2 pages of 16, the second half filled
    return kv, torch.tensor([0, 2]), torch.tensor([3, 1]), torch.zeros(2, 2, 5, 16, 1, 128, dtype=torch.bfloat16)


def _op_cases() -> list[tuple]:
    """(op, args) of every custom op at W = 1."""
    torch.manual_seed(0)
    moe = _moe_inputs()
    names = "a,b"
    kv, src, dst, cache = _kv_inputs()
    return [
        (torch.ops.commweave.gemm_allgather.default, (_bf16(6, 8), _bf16(8, 4), SINGLE, None)),
        (torch.ops.commweave.gemm_reducescatter.default, (_bf16(6, 8), _bf16(8, 4), SINGLE, None)),
        (torch.ops.commweave.context_parallel_attention.default,
         (_bf16(8, 4, 16), _bf16(8, 2, 16), _bf16(8, 2, 16), True, SINGLE, None)),
        (torch.ops.commweave.moe_layer.default, (*moe.values(), SINGLE, None)),
        (torch.ops.commweave.transfer_kv.default, (*_kv_inputs(), SINGLE, None)),
        (torch.ops.commweave.call.default, ("gemm-allgather", None, SINGLE, names, [_bf16(6, 8), _bf16(8, 4)], "")),
        (torch.ops.commweave.call_out.default, ("kv-transfer", None, SINGLE, "dst_blocks,kv,src_blocks",
                                                [dst, kv, src], "", cache)),
    ]


@pytest.mark.parametrize("op,args", _op_cases(), ids=lambda v: str(v).split(".")[-2] if "commweave" in str(v) else "")
def test_opcheck(op, args) -> None:
    """Schema, fake implementation, autograd registration and dispatch, as torch checks them."""
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("op,args", _op_cases(), ids=lambda v: str(v).split(".")[-2] if "commweave" in str(v) else "")
def test_fake_tensors_propagate_shapes(op, args) -> None:
    real = op(*args)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else
                     [mode.from_tensor(t) for t in a] if isinstance(a, list) else a for a in args]
        fake = op(*fake_args)
    if real is None:
        assert fake is None
    else:
        assert fake.shape == real.shape and fake.dtype == real.dtype and fake.device == real.device


# -- W = 1: local results against independent references ------------------------------------------
def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def test_gemm_pair_on_one_rank() -> None:
    a, b = _bf16(6, 8), _bf16(8, 4)
    assert torch.equal(ops.gemm_allgather(a, b), a @ b)
    assert torch.equal(ops.gemm_reducescatter(a, b), a @ b)
    assert torch.equal(ops.op("gemm-allgather")(a=a, b=b), a @ b)
    assert torch.equal(ops.op("gemm-allgather-lossy")(a=a, b=b), a @ b), "a lossy variant computes exactly on one rank"


@pytest.mark.parametrize("causal", [False, True])
def test_attention_on_one_rank(causal: bool) -> None:
    q, k, v = _bf16(24, 4, 16), _bf16(24, 2, 16), _bf16(24, 2, 16)
    want, _ = attention_with_lse(q, k, v, causal=causal, backend="torch")
    got = ops.context_parallel_attention(q, k, v, causal=causal)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    assert _rel(got, want) < 1e-2
    assert _rel(ops.op("attention-cp")(q=q, k=k, v=v, causal=causal), want) < 1e-2


def test_moe_on_one_rank() -> None:
    inputs = _moe_inputs()
    x, idx, w, w13, w2 = (inputs[n].float() if inputs[n].is_floating_point() else inputs[n] for n in inputs)
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):  # every token, every chosen expert, one at a time
        for slot, e in enumerate(idx[t].tolist()):
            gate_up = w13[e] @ x[t]
            h = F.silu(gate_up[:8]) * gate_up[8:]
            want[t] += w[t, slot] * (w2[e] @ h)
    got = ops.moe_layer(*inputs.values())
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    assert _rel(got, want) < 1e-2
    assert _rel(ops.op("moe-lossy")(**inputs), want) < 1e-2


def test_kv_transfer_on_one_rank_is_both_ends() -> None:
    kv, src, dst, cache = _kv_inputs()
    untouched = cache.clone()
    assert ops.transfer_kv(kv, src, dst, cache) is cache
    pages = torch.zeros(2, 2, 32, 1, 128, dtype=torch.bfloat16)
    pages[:, :, :20] = kv
    pages = pages.view(2, 2, 2, 16, 1, 128)
    for i, (s, d) in enumerate(zip(src.tolist(), dst.tolist())):
        assert torch.equal(cache[:, :, s], pages[:, :, i]) and torch.equal(cache[:, :, d], pages[:, :, i])
    assert torch.equal(cache[:, :, 4], untouched[:, :, 4]), "a block no table names is never written"
    out = torch.zeros_like(cache)
    assert ops.op("kv-transfer")(kv=kv, src_blocks=src, dst_blocks=dst, out=out) is out and torch.equal(out, cache)


def test_generic_op_orders_tensors_by_the_workloads_input_names() -> None:
    op = ops.Op("gemm-allgather")  # an Op of its own, so its workload instance can declare names
    op.workload.op_inputs = ("b", "a")
    a, b = _bf16(6, 8), _bf16(8, 4)
    assert op.input_order({"a": a, "b": b}) == ("b", "a")
    assert torch.equal(op(a=a, b=b), a @ b)
    with pytest.raises(ValueError, match=r"unexpected input c for gemm-allgather \(expects b, a\)"):
        op(a=a, b=b, c=a)
    with pytest.raises(ValueError, match="a must be a torch.Tensor, not list"):
        ops.op("gemm-allgather")(a=[1.0], b=b)


# -- torch.compile, autograd, groups ----------------------------------------------------------------
def test_every_op_compiles_fullgraph() -> None:
    moe = _moe_inputs()
    kv, src, dst, cache = _kv_inputs()
    q, k, v = _bf16(8, 4, 16), _bf16(8, 2, 16), _bf16(8, 2, 16)
    a, b = _bf16(6, 8), _bf16(8, 4)
    graphs: list[list[str]] = []

    def backend(gm, example_inputs):
        graphs.append(sorted(str(n.target) for n in gm.graph.nodes if "commweave" in str(n.target)))
        return gm.forward

    def model(a, b, q, k, v, moe, kv, src, dst, cache):
        y = ops.gemm_reducescatter(ops.gemm_allgather(a, b), b.t())
        o = torch.ops.commweave.context_parallel_attention(q, k, v, True, SINGLE, None)  # (the function: SDPA at W = 1)
        o2 = torch.ops.commweave.context_parallel_attention_lse(q[None], k[None], v[None], True, True, SINGLE)[0]
        m = ops.moe_layer(**moe)
        ops.transfer_kv(kv, src, dst, cache)
        g = ops.op("gemm-allgather")(a=a, b=b)
        return y, o, o2, m, g

    eager_cache = cache.clone()
    want = model(a, b, q, k, v, moe, kv, src, dst, eager_cache)
    got = torch.compile(model, fullgraph=True, backend=backend)(a, b, q, k, v, moe, kv, src, dst, cache)
    assert graphs == [["commweave.call", "commweave.context_parallel_attention",
                       "commweave.context_parallel_attention_lse", "commweave.gemm_allgather",
                       "commweave.gemm_reducescatter", "commweave.moe_layer", "commweave.transfer_kv"]], graphs
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    assert torch.equal(cache, eager_cache)


def test_gemm_pair_backward_on_one_rank() -> None:
    a, b = torch.randn(6, 8, requires_grad=True), torch.randn(8, 4, requires_grad=True)
    (ops.gemm_reducescatter(ops.gemm_allgather(a, b), b.t()) ** 2).sum().backward()
    ar, br = a.detach().requires_grad_(), b.detach().requires_grad_()
    (((ar @ br) @ br.t()) ** 2).sum().backward()
    torch.testing.assert_close(a.grad, ar.grad)
    torch.testing.assert_close(b.grad, br.grad)


def test_ops_without_backward_say_so() -> None:
    moe = _moe_inputs()
    moe["w13"].requires_grad_()  # ops.moe_layer has a backward (tests/test_moe_training.py); the generic op not
    with pytest.raises(RuntimeError, match=r"op\('moe'\) has no backward yet, and w13 require grad"):
        ops.op("moe")(**moe)


def test_group_argument() -> None:
    assert group_name(None) == SINGLE == group_name("")
    with pytest.raises(ValueError, match="group must be None, a ProcessGroup, a DeviceMesh or \\(DeviceMesh, dim\\), not int"):
        ops.gemm_allgather(_bf16(2, 2), _bf16(2, 2), group=1)
    with pytest.raises(RuntimeError, match="group 'tp' was named, but torch.distributed is not initialized"):
        ops.gemm_allgather(_bf16(2, 2), _bf16(2, 2), group="tp")
    with pytest.raises(ValueError, match="a has 8 columns but b 7 rows"):
        ops.gemm_allgather(_bf16(2, 8), _bf16(7, 2))
    with pytest.raises(ValueError, match="neither a program of gemm-allgather"):
        ops.gemm_allgather(_bf16(2, 2), _bf16(2, 2), program="no_such_program")


# -- W >= 2: fakes and compiled calls over real groups (gloo workers) --------------------------------
@pytest.fixture(scope="module")
def pool2():
    with WorkerPool(2, device="cpu", job_timeout_s=120) as pool:
        yield pool


def test_fakes_over_a_group_of_two(pool2: WorkerPool) -> None:
    result = pool2.run("ops_jobs:fake_shapes")
    assert result.ok, result.first_failure()
    for value in result.values:
        assert value == {"gemm_allgather": (12, 4), "gemm_reducescatter": (3, 4), "context_parallel_attention": (8, 4, 16),
                         "moe_layer": (6, 16), "call": (12, 4), "mesh": (12, 4)}, value


def test_compiled_calls_take_group_objects(pool2: WorkerPool) -> None:
    result = pool2.run("ops_jobs:compiled_with_group_objects")
    assert result.ok, result.first_failure()
    for value in result.values:
        assert value == {"equal": [True, True, True], "shapes": [(8, 6), (8, 6), (4, 6)]}, value
