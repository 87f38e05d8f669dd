"""Ring attention with a batch dimension, forward (with the LSE) and backward: the differentiable
path of `commweave.ops` (the host baseline of training, on NCCL or gloo).

Rank r of W holds q [B, S/W, Hq, D], k and v [B, S/W, Hkv, D]: its tokens of every sequence of the
batch, in one of two layouts, `shard_ranges` (contiguous: block r; zigzag: chunks r and 2W-1-r of
2W). Either layout goes with causal or full attention (zigzag balances causal work).

- `ring_forward`: W steps; step s attends to the K/V of rank r-s while it moves on to r+1 (P2P,
  overlapped with the attention), block results merged by LSE. Returns out and the LSE backward needs.
- `ring_backward`: ring-flash-attention's scheme. K/V travel the ring again; with each rank's K/V
  travels its dK/dV accumulator (float32), to which every rank adds what its queries owe those
  keys, and after W hops it is home. dQ stays local. The softmax is recomputed per block from the
  saved LSE (`attention_backward_block`): no S x S tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commweave.workloads.attention_cp.attention import (NEG_INF, attention_backward_block, attention_with_lse,
                                                        block_kind, merge_into, shard_ranges)

Segments = list[tuple[tuple[int, int], int]]  # (global [start, end), first local row) per chunk


def segments(seq: int, world: int, rank: int, zigzag: bool) -> Segments:
    """`rank`'s chunks: their global position ranges and where each starts in the local shard."""
    found, row = [], 0
    for a, b in shard_ranges(seq, world, rank, zigzag):
        found.append(((a, b), row))
        row += b - a
    return found


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """A ValueError naming what is wrong unless q [B, L, Hq, D], k and v [B, L, Hkv, D] with Hq a
    multiple of Hkv, one dtype and one device."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"q [B, S/W, Hq, D], k and v [B, S/W, Hkv, D] expected, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k, v {tuple(k.shape)} must share batch, tokens and head dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} KV heads")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share dtype and device, got {q.dtype}/{q.device}, {k.dtype}/{k.device}, "
                         f"{v.dtype}/{v.device}")


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return (1, 0) if group is None else (group.size(), dist.get_rank(group))


def _exchange(group: dist.ProcessGroup, world: int, rank: int, send: torch.Tensor, recv: torch.Tensor) -> list:
    """Start sending `send` to rank + 1 and receiving `recv` from rank - 1 (group ranks)."""
    ops = [dist.P2POp(dist.isend, send, group=group, group_peer=(rank + 1) % world),
           dist.P2POp(dist.irecv, recv, group=group, group_peer=(rank - 1) % world)]
    return dist.batch_isend_irecv(ops)


def _blocks(seq: int, world: int, rank: int, src: int, causal: bool, zigzag: bool):
    """(query rows, key rows, diagonal?) of the blocks rank's queries see of src's keys."""
    for q_range, q_row in segments(seq, world, rank, zigzag):
        for k_range, k_row in segments(seq, world, src, zigzag):
            kind = block_kind(q_range, k_range, causal)
            if kind == "skip":
                continue
            if kind == "partial":
                raise RuntimeError(f"block {q_range} x {k_range} is neither full, diagonal nor masked")
            yield (slice(q_row, q_row + q_range[1] - q_range[0]), slice(k_row, k_row + k_range[1] - k_range[0]),
                   kind == "causal")


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, zigzag: bool,
                 group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, L, Hq, D] in q's dtype, lse [B, L, Hq] float32) of this rank's queries over the
    whole sequence; `group` None is one rank."""
    check_inputs(q, k, v)
    world, rank = _world(group)
    batch, local, hq, d = q.shape
    seq, scale = local * world, d ** -0.5
    acc = torch.zeros(batch, local, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, local, hq), NEG_INF, dtype=torch.float32, device=q.device)
    cur = torch.stack([k, v])  # [2, B, L, Hkv, D]: one message a hop
    spare = torch.empty_like(cur) if world > 1 else None
    for step in range(world):
        src = (rank - step) % world
        reqs = _exchange(group, world, rank, cur, spare) if step < world - 1 else []
        for qs, ks, diagonal in _blocks(seq, world, rank, src, causal, zigzag):
            for b in range(batch):
                o, block_lse = attention_with_lse(q[b, qs], cur[0, b, ks], cur[1, b, ks], causal=diagonal,
                                                  scale=scale, native_gqa=True)
                merge_into(acc[b, qs], lse[b, qs], o, block_lse)
        for req in reqs:
            req.wait()
        if reqs:
            cur, spare = spare, cur
    return acc.to(q.dtype), lse


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, zigzag: bool,
                  group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) float32 for this rank's q, k, v, given `ring_forward`'s out and lse and the
    output's gradient: dk, dv summed over every rank's queries that saw these keys."""
    check_inputs(q, k, v)
    if dout.shape != q.shape or out.shape != q.shape or lse.shape != q.shape[:3]:
        raise ValueError(f"dout {tuple(dout.shape)}, out {tuple(out.shape)} must be q's shape {tuple(q.shape)} "
                         f"and lse {tuple(lse.shape)} [B, S/W, Hq]")
    world, rank = _world(group)
    batch, local, hq, d = q.shape
    seq, scale = local * world, d ** -0.5
    dq = torch.zeros(batch, local, hq, d, dtype=torch.float32, device=q.device)
    cur = torch.stack([k, v])
    spare = torch.empty_like(cur) if world > 1 else None
    part = torch.empty(cur.shape, dtype=torch.float32, device=q.device)  # what this rank's queries owe src's K/V
    dkv = dkv_in = None
    dkv_reqs: list = []
    for step in range(world):
        src = (rank - step) % world
        reqs = _exchange(group, world, rank, cur, spare) if step < world - 1 else []
        part.zero_()
        for qs, ks, diagonal in _blocks(seq, world, rank, src, causal, zigzag):
            for b in range(batch):
                gq, gk, gv = attention_backward_block(dout[b, qs], q[b, qs], cur[0, b, ks], cur[1, b, ks], out[b, qs],
                                                      lse[b, qs], causal=diagonal, scale=scale)
                dq[b, qs] += gq
                part[0, b, ks] += gk
                part[1, b, ks] += gv
        for req in dkv_reqs:  # src's accumulator, from rank - 1, which worked on src last step
            req.wait()
        dkv = part.clone() if dkv_in is None else dkv_in.add_(part)
        if world > 1:  # on to rank + 1, the next to see src's keys; after W hops it is back at src
            dkv_in = torch.empty_like(dkv)
            dkv_reqs = _exchange(group, world, rank, dkv, dkv_in)
        for req in reqs:
            req.wait()
        if reqs:
            cur, spare = spare, cur
    if world > 1:
        for req in dkv_reqs:
            req.wait()
        dkv = dkv_in
    return dq, dkv[0], dkv[1]
