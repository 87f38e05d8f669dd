"""Baseline: all-gather K and V (one NCCL collective), then one attention call per query chunk.

Non-causal: rank order is sequence order, so one `scaled_dot_product_attention` (GQA native)
over the gathered K, V. Causal (zigzag shards): the gathered chunks are put in sequence order,
and each of this rank's two query chunks at [a, b) attends to keys [0, b) with a lower-right
aligned causal mask (`causal_lower_right` on GPUs, which torch runs as one flash kernel;
a materialized boolean mask on CPU). Memory: the whole K and V on every rank.

CONFIG communicate=False skips the all-gather and attends over whatever the gathered buffer holds:
the workload's "ideal" yardstick (this rank's attention with every key already present), timed
beside the programs but wrong by construction.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from commweave.workloads.attention_cp.attention import shard_ranges

# EVOLVE-BLOCK-START
CONFIG = dict(
    communicate=True,  # False: no all-gather (the "ideal" yardstick; the output is wrong)
)


def setup(ctx, shape):
    world, causal = ctx.world_size, bool(shape["CAUSAL"])
    local, hkv, d = shape["S"] // world, shape["HKV"], shape["D"]
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    state = {
        "kv_local": torch.empty(2, local, hkv, d, dtype=torch.bfloat16, device=ctx.device),
        "kv_all": torch.empty(world, 2, local, hkv, d, dtype=torch.bfloat16, device=ctx.device),
        "gather": gather, "causal": causal, "scale": d ** -0.5,
        "ranges": shard_ranges(shape["S"], world, ctx.rank, causal),
    }
    if causal:
        state["kv_seq"] = torch.empty(2, shape["S"], hkv, d, dtype=torch.bfloat16, device=ctx.device)
    if not CONFIG["communicate"]:  # keys like the inputs' (N(0, 1)), so the attention's work is the same
        for name in ("kv_all", "kv_seq"):
            if name in state:
                state[name].normal_()
    return state


def _sdpa(q, k, v, scale, mask=None):
    """[S, H, D] tensors through SDPA's [1, H, S, D] layout."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                       v.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale,
                                       enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1)


def run(ctx, state, inputs, out):
    world = ctx.world_size
    kv_local, kv_all = state["kv_local"], state["kv_all"]
    if CONFIG["communicate"]:
        kv_local[0].copy_(inputs["k"])
        kv_local[1].copy_(inputs["v"])
        # the output as W copies of the input's shape stacked on dim 0 (gloo checks that)
        state["gather"](kv_all.view(-1, *kv_all.shape[2:]), kv_local, group=ctx.group)
    q = inputs["q"]
    if not state["causal"]:
        s = kv_all.shape[0] * kv_all.shape[2]
        k = kv_all[:, 0].reshape(s, *kv_all.shape[3:])
        v = kv_all[:, 1].reshape(s, *kv_all.shape[3:])
        out.copy_(_sdpa(q, k, v, state["scale"]))
        return
    kv_seq = state["kv_seq"]
    half = kv_all.shape[2] // 2
    for r in range(world if CONFIG["communicate"] else 0):  # rank r holds chunks r and 2W-1-r
        kv_seq[:, r * half:(r + 1) * half] = kv_all[r, :, :half]
        kv_seq[:, (2 * world - 1 - r) * half:(2 * world - r) * half] = kv_all[r, :, half:]
    row = 0
    for a, b in state["ranges"]:
        n = b - a
        if q.is_cuda:  # one flash kernel with a lower-right aligned causal mask
            from torch.nn.attention.bias import causal_lower_right  # imports torch._dynamo: seconds

            mask = causal_lower_right(n, b)
        else:  # the same mask, materialized (CPU workers, small shapes)
            mask = torch.ones(n, b, dtype=torch.bool, device=q.device).tril(b - n)
        out[row:row + n] = _sdpa(q[row:row + n], kv_seq[0, :b], kv_seq[1, :b], state["scale"], mask)
        row += n
# EVOLVE-BLOCK-END
