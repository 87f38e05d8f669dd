"""Jobs for tests/test_attention_cp_backward.py: context-parallel attention trained over a group (CPU
gloo workers), against one float32 single-process autograd computation over the whole sequence."""

from __future__ import annotations

import torch
import torch.distributed as dist

from commweave.workloads.attention_cp.attention import shard_positions


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def full_data(batch: int, seq: int, hq: int, hkv: int, dim: int) -> tuple[torch.Tensor, ...]:
    """q [B, S, Hq, D] (~2 N(0,1): a peaked softmax), k, v [B, S, Hkv, D], bf16 values, and the
    output's upstream gradient g, float32; the same on every rank."""
    gen = torch.Generator().manual_seed(4321)
    q = (torch.randn(batch, seq, hq, dim, generator=gen) * 2).bfloat16()
    k = torch.randn(batch, seq, hkv, dim, generator=gen).bfloat16()
    v = torch.randn(batch, seq, hkv, dim, generator=gen).bfloat16()
    return q, k, v, torch.randn(batch, seq, hq, dim, generator=gen)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              causal: bool) -> dict[str, torch.Tensor]:
    """out and the gradients of sum(out * g) by float32 autograd through plain softmax attention."""
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kr, vr = kf.repeat_interleave(group, dim=2), vf.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kr) / q.shape[-1] ** 0.5
    if causal:
        seq = q.shape[1]
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vr)
    (out * g).sum().backward()
    return {"out": out.detach(), "dq": qf.grad, "dk": kf.grad, "dv": vf.grad}


def cp_training(ctx, batch: int, seq: int, hq: int, hkv: int, dim: int, causal: bool, layout: str,
                compiled: bool = False, functional: bool = False) -> dict:
    """One training step of `ContextParallelAttention` (or `ops.context_parallel_attention` when
    `functional`) on this rank's shard in `layout`: relative errors of out, dq, dk, dv against the
    reference; `compiled`: also under torch.compile(fullgraph=True, aot_eager), its errors, its
    difference from eager and the commweave ops in its graphs."""
    import commweave.ops as ops
    from commweave.nn import ContextParallelAttention

    q, k, v, g = full_data(batch, seq, hq, hkv, dim)
    want = reference(q, k, v, g, causal)
    pos = shard_positions(seq, ctx.world_size, ctx.rank, layout == "zigzag")
    want = {name: t[:, pos] for name, t in want.items()}
    group = dist.group.WORLD
    module = ContextParallelAttention(causal=causal, layout=layout, group=group)

    def step(fn) -> dict[str, torch.Tensor]:
        ql, kl, vl = (t[:, pos].clone().requires_grad_() for t in (q, k, v))
        out = fn(ql, kl, vl)
        (out.float() * g[:, pos]).sum().backward()
        return {"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}

    if functional:
        eager = step(lambda a, b, c: ops.context_parallel_attention(a, b, c, causal=causal, group=group, layout=layout))
    else:
        eager = step(module)
    result = {"errors": {n: _rel(eager[n], want[n]) for n in want},
              "dtypes": sorted({str(t.dtype) for t in eager.values()}),
              "shapes": {n: tuple(t.shape) for n, t in eager.items()}}
    if compiled:
        torch._dynamo.reset()
        graphs: list[list[str]] = []

        def backend(gm, example_inputs):
            graphs.append(sorted(str(n.target) for n in gm.graph.nodes if "commweave" in str(n.target)))
            return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

        fast = step(torch.compile(module, fullgraph=True, backend=backend))
        result["graphs"] = graphs
        result["compiled_errors"] = {n: _rel(fast[n], want[n]) for n in want}
        result["compiled_vs_eager"] = {n: _rel(fast[n], eager[n]) for n in want}
    return result
