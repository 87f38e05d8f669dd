"""Host baseline (a): one peer copy per block, issued from the host, no staging.

After the whole prefill (stand-in GEMMs and reshape_and_cache, as in `host`), the source sends
every page of the sequence — (layer, K/V, block): L * 2 * nb pages of 16 * KV * D bf16 — straight
from its cache page src_blocks[i] into the destination's cache page dst_blocks[i] with one
point-to-point op each (`dist.isend` / `dist.irecv` on page views, no gather buffer), a layer's
2 * nb ops batched into one `batch_isend_irecv` (one NCCL group per layer on GPUs). The block
tables are read to the host once per call, as a connector holds them there. Runs over gloo too.
"""

import torch.distributed as dist

from commweave.workloads.kv_transfer.prefill import PrefillLayers

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    src = ctx.rank - ctx.rank % 2
    state = {"src": src, "dst": src + 1, "is_src": ctx.rank == src,
             "prefill": PrefillLayers(shape, ctx.device) if ctx.rank == src else None}
    return state


def run(ctx, state, inputs, out):
    if state["is_src"]:
        for layer in range(out.shape[0]):
            state["prefill"].layer(inputs, out, layer)
        blocks, op, peer = inputs["src_blocks"].tolist(), dist.isend, state["dst"]
    else:
        blocks, op, peer = inputs["dst_blocks"].tolist(), dist.irecv, state["src"]
    for layer in range(out.shape[0]):
        ops = [dist.P2POp(op, out[layer, half, block], group=ctx.group, group_peer=peer) for half in range(2) for block in blocks]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
# EVOLVE-BLOCK-END
