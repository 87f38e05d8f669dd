"""Host baseline: what an expert-parallel MoE layer in plain PyTorch does, step by step.

1. count exchange: each rank's per-expert pair counts go to the experts' ranks
   (`all_to_all_single` on E ints; the counts come to the host for the split sizes);
2. dispatch: every (token, expert) pair's row, sorted by expert, with variable-size
   `all_to_all_single`;
3. experts: rows regrouped by local expert, SwiGLU per expert: `torch._grouped_mm` with the
   group ends on device (CONFIG experts="grouped", the default where torch has it) or a loop of
   per-expert matmuls ("loop");
4. combine: results back with the reverse `all_to_all_single`;
5. weighted sum over each token's k results (fp32), cast to bf16.

Serialized on the current stream, with host synchronizations for the split sizes. Runs unchanged
on CPU workers over gloo (torch 2.13's gloo backend implements `all_to_all_single` with
uneven splits), which the CPU tests use.

CONFIG `train=True` (the workload's `train_host` yardstick, which `commweave bench moe` times
beside the forward): a training step instead, the training path of `commweave.ops.moe_layer`
(`workloads/moe/training.py`: the same exchange, keeping what the backward needs) and its backward
with the output itself standing in for the loss's gradient (the gradients are dropped); `out` gets
the forward's output.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from commweave.workloads.moe import training

# EVOLVE-BLOCK-START
CONFIG = dict(
    experts="grouped",  # "grouped": torch._grouped_mm over all local experts; "loop": one matmul chain each
    train=False,  # True: forward + backward of the training path (a training step's time; see the docstring)
)


def setup(ctx, shape):
    if CONFIG["experts"] not in ("grouped", "loop"):
        raise ValueError(f"CONFIG['experts'] must be 'grouped' or 'loop', not {CONFIG['experts']!r}")
    grouped = CONFIG["experts"] == "grouped" and hasattr(torch, "_grouped_mm")
    return {"E": shape["E"], "K": shape["K"], "I": shape["I"], "grouped": grouped}


def run(ctx, state, inputs, out):
    if CONFIG["train"]:
        names = ("x", "topk_idx", "topk_weights", "w13", "w2")
        y, saved = training.forward(*(inputs[n] for n in names), ctx.group)
        training.backward(y, *(inputs[n] for n in names[1:]), saved, ctx.group)
        out.copy_(y)
        return
    world = ctx.world_size
    x, idx, w = inputs["x"], inputs["topk_idx"], inputs["topk_weights"]
    n_experts, top_k, inter = state["E"], state["K"], state["I"]
    per_rank = n_experts // world
    flat = idx.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # pairs grouped by expert, hence by rank
    counts = torch.bincount(flat, minlength=n_experts)
    # 1. counts: recv_counts[s * per_rank + e] = pairs source s sends to local expert e
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=ctx.group)
    send_splits = counts.view(world, per_rank).sum(1).tolist()
    recv_matrix = recv_counts.view(world, per_rank)
    recv_splits = recv_matrix.sum(1).tolist()
    # 2. dispatch
    send_rows = x.index_select(0, order // top_k)
    recv_rows = x.new_empty(sum(recv_splits), x.shape[1])
    dist.all_to_all_single(recv_rows, send_rows, recv_splits, send_splits, group=ctx.group)
    # 3. experts: received rows are ordered (source, local expert); regroup by local expert
    local_expert = torch.repeat_interleave(torch.arange(per_rank, device=x.device).repeat(world), recv_matrix.reshape(-1))
    by_expert = torch.sort(local_expert, stable=True).indices
    grouped = recv_rows.index_select(0, by_expert)
    per_expert = recv_matrix.sum(0)
    if state["grouped"] and grouped.shape[0]:
        ends = per_expert.cumsum(0).to(torch.int32)
        gate_up = torch._grouped_mm(grouped, inputs["w13"].transpose(-2, -1), offs=ends)
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        results = torch._grouped_mm(h, inputs["w2"].transpose(-2, -1), offs=ends)
    else:
        results = torch.empty_like(grouped)
        start = 0
        for e, n in enumerate(per_expert.tolist()):
            if n:
                rows = grouped[start:start + n]
                gate_up = rows @ inputs["w13"][e].t()
                h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
                results[start:start + n] = h @ inputs["w2"][e].t()
            start += n
    back_rows = torch.empty_like(results)
    back_rows[by_expert] = results
    # 4. combine
    returned = x.new_empty(flat.numel(), x.shape[1])
    dist.all_to_all_single(returned, back_rows, send_splits, recv_splits, group=ctx.group)
    # 5. weighted sum
    per_pair = torch.empty_like(returned)
    per_pair[order] = returned
    y = (per_pair.view(x.shape[0], top_k, -1).float() * w.unsqueeze(-1)).sum(1)
    out.copy_(y)
# EVOLVE-BLOCK-END
