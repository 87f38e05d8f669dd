"""Host baseline (a): one peer copy per block, issued from the host, no staging.

After the whole prefill (stand-in GEMMs and reshape_and_cache, as in `host`), the source sends
every page of the sequence — (layer, K/V, block): L * 2 * nb pages of 16 * KV * D bf16 — straight
from its cache page src_blocks[i] into the destination's cache page dst_blocks[i] with one
point-to-point op each (`dist.isend` / `dist.irecv` on page views, no gather buffer), a layer's
2 * nb ops batched into one `batch_isend_irecv` (one NCCL group per layer on GPUs). The block
tables are read to the host once per call, as a connector holds them there. Runs over gloo too.
"""

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    src = ctx.rank - ctx.rank % 2
    state = {"src": src, "dst": src + 1, "is_src": ctx.rank == src, "passes": shape["P"],
             "tail": torch.zeros(2, 1, 16, shape["KV"], shape["D"], dtype=torch.bfloat16, device=ctx.device)}
    if state["is_src"] and shape["P"]:
        state["scratch"] = torch.empty(shape["S"], 4096, dtype=torch.bfloat16, device=ctx.device)
    return state


def prefill_layer(state, inputs, cache, layer, passes):
    """The stand-in prefill of one layer, then its K/V written into the paged cache."""
    for _ in range(passes):
        torch.matmul(inputs["x"], inputs["w"], out=state["scratch"])
    kv, blocks = inputs["kv"], inputs["src_blocks"]
    tokens, full = kv.shape[2], kv.shape[2] // 16
    if full:
        pages = kv[layer, :, :full * 16].reshape(2, full, 16, kv.shape[3], kv.shape[4])
        cache[layer].index_copy_(1, blocks[:full], pages)
    if tokens % 16:
        tail = state["tail"]
        tail[:, 0, :tokens % 16] = kv[layer, :, full * 16:]
        cache[layer].index_copy_(1, blocks[full:], tail)


def run(ctx, state, inputs, out):
    if state["is_src"]:
        for layer in range(out.shape[0]):
            prefill_layer(state, inputs, out, layer, state["passes"])
        blocks, op, peer = inputs["src_blocks"].tolist(), dist.isend, state["dst"]
    else:
        blocks, op, peer = inputs["dst_blocks"].tolist(), dist.irecv, state["src"]
    for layer in range(out.shape[0]):
        ops = [dist.P2POp(op, out[layer, half, block], peer, group=ctx.group) for half in range(2) for block in blocks]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
# EVOLVE-BLOCK-END
