"""Routing for the DeepSeek-V3 MoE layer: the real gate, skewed routings, and slot layouts.

Everything here is plain torch (CPU or GPU) with no communication, so it is tested on CPU and is
the model the programs' kernels follow.

- `gate_route`: DeepSeek-V3's gate (sigmoid scores, a score-correction bias used only for the
  choice, group-limited top-k: each group scored by the sum of its two best experts, the best
  `topk_groups` groups kept, top-k experts among them; weights are the chosen experts' sigmoid
  scores normalized to sum 1, times the routed scaling factor 2.5).
- `skewed_route`: a routing in which the expert-parallel rank holding experts
  [0, E/W) receives `ratio` times as many (token, expert) assignments as each other rank
  (ratio 1 is uniform); experts within a rank are drawn uniformly, distinct per token.
  Group limits do not apply to it (it models load imbalance, not the gate).
- `slot_layout`: each (token, expert) pair's slot among its source's pairs for a destination,
  grouped by local expert; `expert_major_bases`/`expert_major_positions` turn slots into rows of
  the destination's expert-major receive pool, the layout the device-initiated seed's dispatch
  kernel writes (see programs/seed.py); `expert_group_ends` are that pool's grouped-GEMM ends.
"""

from __future__ import annotations

import torch

ROUTED_SCALING = 2.5  # DeepSeek-V3 routed_scaling_factor


def check_routing_params(n_experts: int, top_k: int, n_groups: int, topk_groups: int) -> None:
    """A clear ValueError for a routing configuration the gate cannot serve."""
    if min(n_experts, top_k, n_groups, topk_groups) <= 0:
        raise ValueError(f"experts ({n_experts}), top-k ({top_k}), groups ({n_groups}) and top groups ({topk_groups}) must be positive")
    if n_experts % n_groups:
        raise ValueError(f"{n_experts} experts cannot be split into {n_groups} equal groups")
    if topk_groups > n_groups:
        raise ValueError(f"top groups ({topk_groups}) exceed the number of groups ({n_groups})")
    per_group = n_experts // n_groups
    if per_group < 2:
        raise ValueError(f"groups are scored by their two best experts; {per_group} expert per group is too few")
    if top_k > topk_groups * per_group:
        raise ValueError(f"top-{top_k} cannot be chosen from {topk_groups} groups of {per_group} experts")


def gate_route(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, n_groups: int,
               topk_groups: int, scaling: float = ROUTED_SCALING) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 group-limited routing of tokens x [T, H] with gate weights [E, H] and the
    score-correction bias [E]. Returns (expert ids [T, top_k] int64, weights [T, top_k] float32)."""
    n_tokens = x.shape[0]
    n_experts = gate_w.shape[0]
    check_routing_params(n_experts, top_k, n_groups, topk_groups)
    scores = torch.sigmoid(x.float() @ gate_w.float().t())  # [T, E]
    choice = scores + bias.float()
    group_scores = choice.view(n_tokens, n_groups, -1).topk(2, dim=-1).values.sum(-1)  # [T, G]
    groups = group_scores.topk(topk_groups, dim=-1).indices  # [T, topk_groups]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    expert_mask = group_mask.repeat_interleave(n_experts // n_groups, dim=1)
    masked = choice.masked_fill(~expert_mask, float("-inf"))
    idx = masked.topk(top_k, dim=-1).indices
    w = scores.gather(1, idx)
    w = w / w.sum(-1, keepdim=True) * scaling
    return idx, w.float()


def rank_shares(world_size: int, ratio: int) -> list[float]:
    """Fraction of all (token, expert) assignments each rank receives: rank 0 gets `ratio` times
    what each other rank gets."""
    if ratio < 1:
        raise ValueError(f"imbalance ratio must be >= 1, got {ratio}")
    total = ratio + world_size - 1
    return [ratio / total] + [1 / total] * (world_size - 1)


def skewed_route(n_tokens: int, n_experts: int, top_k: int, world_size: int, ratio: int,
                 gen: torch.Generator, device: torch.device,
                 scaling: float = ROUTED_SCALING) -> tuple[torch.Tensor, torch.Tensor]:
    """A routing of n_tokens tokens whose per-rank assignment totals follow `rank_shares` (exactly,
    up to one assignment per rank): assignments are dealt to ranks by smooth weighted round robin
    over the token-major sequence of all T*top_k slots, then each token's experts on a rank are
    drawn uniformly without repetition. Weights: normalized sigmoids of random logits x scaling."""
    if n_experts % world_size:
        raise ValueError(f"{n_experts} experts cannot be split evenly over {world_size} ranks")
    per_rank = n_experts // world_size
    shares = rank_shares(world_size, ratio)
    if per_rank < top_k:
        raise ValueError(f"skewed routing needs at least top-k ({top_k}) experts per rank, not {per_rank}")
    # Smooth weighted round robin (deterministic): slot i goes to the rank furthest behind its quota.
    counts = torch.zeros(n_tokens, world_size, dtype=torch.int64)
    dealt = [0] * world_size
    for i in range(n_tokens * top_k):
        behind = [(i + 1) * shares[j] - dealt[j] for j in range(world_size)]
        j = max(range(world_size), key=lambda r: behind[r])
        dealt[j] += 1
        counts[i // top_k, j] += 1
    keys = torch.rand(n_tokens, n_experts, generator=gen, device=device).view(n_tokens, world_size, per_rank)
    order = keys.argsort(dim=-1).argsort(dim=-1)  # each expert's rank among its rank's experts
    chosen = order < counts.to(device).unsqueeze(-1)  # [T, W, per_rank]: the first counts[t, j]
    idx = chosen.view(n_tokens, n_experts).nonzero()[:, 1].view(n_tokens, top_k)
    logits = torch.randn(n_tokens, top_k, generator=gen, device=device)
    w = torch.sigmoid(logits)
    w = w / w.sum(-1, keepdim=True) * scaling
    return idx, w.float()


def rank_loads(idx: torch.Tensor, n_experts: int, world_size: int) -> torch.Tensor:
    """Assignments per expert-parallel rank [W] (expert e lives on rank e // (E/W))."""
    per_rank = n_experts // world_size
    return torch.bincount((idx.reshape(-1) // per_rank).cpu(), minlength=world_size)


# -- slot layout (the seed's dispatch) ----------------------------------------------------------
def pool_rows_per_source(n_tokens: int, top_k: int) -> int:
    """Rows a destination reserves per source: all T*top_k pairs of that source. A source cannot
    send more (even a routing with repeated experts), so a pool of W such shares never overflows
    and no token is ever dropped; the cost is memory (W*T*K rows per rank: 1.9 GB at T=4096 on 4
    GPUs)."""
    return n_tokens * top_k


def slot_layout(idx: torch.Tensor, n_experts: int, world_size: int) -> dict[str, torch.Tensor]:
    """The sender-side layout of the seed's dispatch for one source's routing idx [T, K].

    Pairs p = t*K + k are sorted stably by expert id; since a rank's experts are contiguous, the
    sorted list is grouped by destination rank, then by local expert. A pair's slot in its
    destination's region for this source is its position in the sorted list minus the position of
    its destination's first pair. Returns
      order [T*K]      pair ids in sorted order,
      dest [T*K]       destination rank of each pair (by pair id),
      slot [T*K]       slot of each pair (by pair id) within its destination's region for this source,
      dest_start [W+1] where each destination's pairs begin in `order`,
      counts [E]       pairs per expert (what the destination receives from this source, per expert).
    """
    per_rank = n_experts // world_size
    flat = idx.reshape(-1).long()
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    order = torch.sort(flat, stable=True).indices
    dest = flat // per_rank
    per_dest = counts.view(world_size, per_rank).sum(1)
    dest_start = torch.zeros(world_size + 1, dtype=torch.int64, device=flat.device)
    dest_start[1:] = per_dest.cumsum(0)
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=flat.device)
    slot = position - dest_start[dest]
    return {"order": order, "dest": dest, "slot": slot, "dest_start": dest_start, "counts": counts}


def expert_major_bases(counts: torch.Tensor, src: int) -> torch.Tensor:
    """The seed's dispatch offset (`moe_expert_base` in programs/seed.py), for one destination
    whose sources send counts [W, E/W] rows per local expert: base[e] is added to the slot a pair
    of source `src` for local expert e has in src's sorted routing (`slot_layout`), giving its row
    in the destination's expert-major pool:
      base[e] = sum_{e' < e} sum_s counts[s, e']    (where expert e's rows start)
              + sum_{s < src} counts[s, e]          (lower sources' rows of expert e come first)
              - sum_{e' < e} counts[src, e']        (src's own slot of its first pair for e).
    So expert e's rows are contiguous, ordered by source, each source's rows in slot order."""
    counts = counts.long()
    totals = counts.sum(0)
    own = counts[src]
    return (totals.cumsum(0) - totals) + counts[:src].sum(0) - (own.cumsum(0) - own)


def expert_major_positions(slot: torch.Tensor, local_expert: torch.Tensor, counts: torch.Tensor, src: int) -> torch.Tensor:
    """Rows in the destination's expert-major pool of source `src`'s pairs with these slots
    (`slot_layout`'s, within src's pairs for this destination) and local expert ids."""
    return slot + expert_major_bases(counts, src)[local_expert]


def expert_group_ends(counts: torch.Tensor) -> torch.Tensor:
    """Group ends (int32, cumulative) of the expert-major pool filled from counts [W, E/W], for
    torch._grouped_mm: local expert e's rows are [ends[e-1], ends[e]); rows past ends[-1] are
    unused and ignored by the grouped GEMMs. Device ops, no host sync."""
    return counts.sum(0).cumsum(0).to(torch.int32)
