"""Host baseline, padded all-to-all: fixed-size exchanges instead of variable splits.

The variant CUCo's paper compares against: every (source, expert) bucket is padded to one
capacity C, the largest bucket over all ranks (one `all_reduce(MAX)` of the per-expert counts;
its value comes to the host to size the buffers), so dispatch and combine are equal-split
`all_to_all_single` on [W, E/W, C, H] buffers and no count exchange is needed: padding rows are
zeros and come back as zeros (SwiGLU(0) = 0), each expert runs on all W*C rows of its bucket
(one batched matmul over the E/W experts per projection).
Padding costs bytes and FLOPs under skew; the layout costs no regrouping.

Runs unchanged on CPU workers over gloo (all_reduce MAX and all_to_all_single are supported).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {"E": shape["E"], "K": shape["K"], "I": shape["I"]}


def run(ctx, state, inputs, out):
    world = ctx.world_size
    x, idx, w = inputs["x"], inputs["topk_idx"], inputs["topk_weights"]
    n_experts, top_k, inter = state["E"], state["K"], state["I"]
    per_rank, hidden = n_experts // world, x.shape[1]
    flat = idx.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    sorted_experts = flat[order]
    counts = torch.bincount(flat, minlength=n_experts)
    largest = counts.max().reshape(1)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=ctx.group)
    cap = int(largest.item())
    # bucket position of each sorted pair: (expert, rank of the pair within its expert)
    starts = counts.cumsum(0) - counts
    within = torch.arange(flat.numel(), device=x.device) - starts[sorted_experts]
    bucket_row = sorted_experts * cap + within  # row in the [E * C, H] send buffer
    send = x.new_zeros(n_experts * cap, hidden)
    send[bucket_row] = x.index_select(0, order // top_k)
    recv = torch.empty_like(send)  # [W (sources), E/W, C, H] after the exchange
    dist.all_to_all_single(recv, send, group=ctx.group)
    buckets = recv.view(world, per_rank, cap, hidden)
    rows = buckets.transpose(0, 1).reshape(per_rank, world * cap, hidden)  # [E/W, W*C, H]
    gate_up = torch.bmm(rows, inputs["w13"].transpose(1, 2))
    h = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    y = torch.bmm(h, inputs["w2"].transpose(1, 2))  # [E/W, W*C, H]
    results = y.view(per_rank, world, cap, hidden).transpose(0, 1).contiguous()
    returned = torch.empty_like(send)
    dist.all_to_all_single(returned, results.view(n_experts * cap, hidden), group=ctx.group)
    per_pair = torch.empty(flat.numel(), hidden, dtype=x.dtype, device=x.device)
    per_pair[order] = returned[bucket_row]
    y = (per_pair.view(x.shape[0], top_k, hidden).float() * w.unsqueeze(-1)).sum(1)
    out.copy_(y)
# EVOLVE-BLOCK-END
