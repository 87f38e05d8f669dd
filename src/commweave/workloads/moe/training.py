"""The MoE layer's training path: a forward that keeps what the backward needs, and the backward,
both in plain torch with the host all-to-all exchange (gloo on CPU, NCCL on GPUs; no exchange at
all on one rank).

The backward is the forward's exchanges swapped (DeepEP's duality): the combine's backward is a
dispatch (each token's output gradient, times its routing weight, goes to the ranks of its top-k
experts, along the forward dispatch's splits and into the same expert-major rows), and the
dispatch's backward is a combine (the rows' input gradients come back to their tokens along the
forward combine's splits and are summed over the token's k experts). Between them the experts'
backward is local: two grouped GEMMs for the activation gradients and two for the weight gradients.

Saved tensors have static shapes, so torch.compile can carry them between its forward and backward
graphs: the expert-side rows (received rows, gate/up products, SwiGLU outputs) are held at their
bound W*T*K rows (no source sends more than its T*K pairs), of which the first N (the rows this
rank received) are valid; on one rank that bound is exact. Nothing is recomputed in backward.

Per rank the non-communication work is a local MoE's under autograd: one row gather, the two
grouped GEMMs, SiLU * up and the weighted sum forward; the same four grouped GEMMs, the SiLU
backward, the weighted-sum backward and one scatter-add backward. The one difference: SiLU(gate)
is recomputed in backward (one elementwise pass over N x I) rather than kept, which saves N x I
values a layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Saved:
    """What the forward keeps for the backward (static shapes, R = W*T*K rows on the expert side)."""

    pair_outputs: Tensor  # [T*K, H] each (token, slot)'s expert output, unweighted, at the token's rank
    rows: Tensor  # [R, H] the received token rows, grouped by local expert (first N valid)
    gate_up: Tensor  # [R, 2I] rows @ w13^T
    hidden: Tensor  # [R, I] SiLU(gate) * up
    order: Tensor  # [T*K] int64: pair ids t*K + k sorted (stably) by expert id
    counts: Tensor  # [E] int64: this rank's pairs per expert
    recv_counts: Tensor  # [E] int64: recv_counts[s * E/W + e] = rows source s sent to local expert e

    def as_tuple(self) -> tuple[Tensor, ...]:
        return self.pair_outputs, self.rows, self.gate_up, self.hidden, self.order, self.counts, self.recv_counts


@dataclass(frozen=True)
class Layout:
    """One call's exchange plan on one rank, from the routing and the counts received."""

    order: Tensor  # [T*K] pair ids t*K + k sorted (stably) by expert id: grouped by destination rank
    send_splits: list[int]  # pairs sent to each rank
    recv_splits: list[int]  # rows received from each rank
    by_expert: Tensor | None  # received rows (source-major) -> expert-major; None on one rank (already so)
    ends: Tensor  # [E/W] int32 cumulative rows per local expert (torch._grouped_mm's offs)
    rows: int  # N: rows received


def _layout(order: Tensor, counts: Tensor, recv_counts: Tensor, world: int, per_rank: int) -> Layout:
    """The exchange plan. The split sizes come to the host, as all_to_all_single needs them."""
    recv_matrix = recv_counts.view(world, per_rank)
    ends = recv_matrix.sum(0).cumsum(0).to(torch.int32)
    if world == 1:
        return Layout(order, [], [], None, ends, order.numel())
    local_expert = torch.repeat_interleave(torch.arange(per_rank, device=order.device).repeat(world),
                                           recv_matrix.reshape(-1))
    recv_splits = recv_matrix.sum(1).tolist()
    return Layout(order, counts.view(world, per_rank).sum(1).tolist(), recv_splits,
                  torch.sort(local_expert, stable=True).indices, ends, sum(recv_splits))


def _exchange(rows: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    """all_to_all_single of token rows: in_splits[r] rows of `rows` go to rank r, out_splits[r]
    rows come from it."""
    out = rows.new_empty(sum(out_splits), rows.shape[1])
    dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
    return out


def _to_experts(sorted_rows: Tensor, layout: Layout, bound: int, group: dist.ProcessGroup | None) -> Tensor:
    """Rows in this rank's sorted pair order -> the expert side's [bound, H], grouped by local
    expert (the first N rows valid): the dispatch."""
    if layout.by_expert is None:
        return sorted_rows
    received = _exchange(sorted_rows, layout.recv_splits, layout.send_splits, group)
    out = sorted_rows.new_empty(bound, sorted_rows.shape[1])
    torch.index_select(received, 0, layout.by_expert, out=out[:layout.rows])
    return out


def _to_tokens(expert_rows: Tensor, layout: Layout, group: dist.ProcessGroup | None) -> Tensor:
    """The expert side's rows -> this rank's pairs in sorted pair order [T*K, H]: the combine."""
    if layout.by_expert is None:
        return expert_rows
    source_major = expert_rows.new_empty(layout.rows, expert_rows.shape[1])
    source_major.index_copy_(0, layout.by_expert, expert_rows[:layout.rows])
    return _exchange(source_major, layout.send_splits, layout.recv_splits, group)


def _recv_counts(counts: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Rows each source sends to each local expert [E]; on one rank the counts themselves (a copy
    of E integers: the custom op returns both, and its outputs may not alias)."""
    if group is None:
        return counts.clone()
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    return received


def forward(x: Tensor, idx: Tensor, weights: Tensor, w13: Tensor, w2: Tensor,
            group: dist.ProcessGroup | None) -> tuple[Tensor, Saved]:
    """out [T, H] = sum_k weights[t, k] * expert_{idx[t, k]}(x[t]) over `group` (None: one rank,
    every expert local), and what the backward needs."""
    world = 1 if group is None else group.size()
    tokens, top_k = idx.shape
    per_rank, inter = w13.shape[0], w13.shape[1] // 2
    flat = idx.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(per_rank * world, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    recv_counts = _recv_counts(counts, group)
    layout = _layout(order, counts, recv_counts, world, per_rank)
    bound = world * tokens * top_k
    rows = _to_experts(x.index_select(0, layout.order // top_k), layout, bound, group)
    gate_up = torch._grouped_mm(rows, w13.transpose(-2, -1), offs=layout.ends)
    hidden = gate_up.new_empty(bound, inter)
    valid = gate_up[:layout.rows]
    torch.mul(F.silu(valid[:, :inter]), valid[:, inter:], out=hidden[:layout.rows])
    results = torch._grouped_mm(hidden, w2.transpose(-2, -1), offs=layout.ends)
    pair_outputs = x.new_empty(tokens * top_k, x.shape[1])
    pair_outputs.index_copy_(0, layout.order, _to_tokens(results, layout, group))
    out = (pair_outputs.view(tokens, top_k, -1) * weights.unsqueeze(-1)).sum(1).to(x.dtype)  # fp32 products
    return out, Saved(pair_outputs, rows, gate_up, hidden, order, counts, recv_counts)


def backward(grad: Tensor, idx: Tensor, weights: Tensor, w13: Tensor, w2: Tensor, saved: Saved,
             group: dist.ProcessGroup | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad_x [T, H], grad_weights [T, K] float32, grad_w13 [E/W, 2I, H], grad_w2 [E/W, H, I])
    from the output's gradient [T, H]: collective over `group` like the forward."""
    world = 1 if group is None else group.size()
    tokens, top_k = idx.shape
    per_rank, inter = w13.shape[0], w13.shape[1] // 2
    layout = _layout(saved.order, saved.counts, saved.recv_counts, world, per_rank)
    grad32 = grad.float().unsqueeze(1)  # [T, 1, H]
    pairs = saved.pair_outputs.view(tokens, top_k, -1)
    grad_weights = (grad32 * pairs).sum(-1)  # promoted to fp32 inside the product: no fp32 copy of pairs
    grad_pairs = (grad32 * weights.unsqueeze(-1)).to(grad.dtype).view(tokens * top_k, -1)
    # the combine's backward: a dispatch of the pairs' output gradients to the experts' rows
    grad_results = _to_experts(grad_pairs.index_select(0, layout.order), layout, saved.rows.shape[0], group)
    grad_w2 = torch._grouped_mm(grad_results.t(), saved.hidden, offs=layout.ends)
    grad_hidden = torch._grouped_mm(grad_results, w2, offs=layout.ends)
    n = layout.rows
    gate, up = saved.gate_up[:n, :inter], saved.gate_up[:n, inter:]
    grad_gate_up = saved.gate_up.new_empty(saved.gate_up.shape)
    valid = grad_hidden[:n]
    torch.mul(valid, F.silu(gate), out=grad_gate_up[:n, inter:])
    torch.ops.aten.silu_backward.grad_input(valid * up, gate, grad_input=grad_gate_up[:n, :inter])
    grad_w13 = torch._grouped_mm(grad_gate_up.t(), saved.rows, offs=layout.ends)
    grad_rows = torch._grouped_mm(grad_gate_up, w13, offs=layout.ends)
    # the dispatch's backward: a combine of the rows' gradients back to their tokens, summed over k
    grad_x = torch.zeros(tokens, grad.shape[1], dtype=grad.dtype, device=grad.device)
    grad_x.index_add_(0, layout.order // top_k, _to_tokens(grad_rows, layout, group))
    return grad_x, grad_weights, grad_w13, grad_w2
