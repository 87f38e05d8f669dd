"""Host baseline (b): after the whole prefill, gather the sequence's pages into one contiguous
buffer, one NCCL send/recv, scatter into the destination's pages.

Source: per layer the stand-in prefill (P GEMMs) and vLLM's reshape_and_cache (the layer's new K/V
into pages src_blocks, zero-padded past S); then `index_select` of all layers' pages into a
contiguous [L, 2, nb, 16, KV, D] buffer and one `dist.send`. Destination: one `dist.recv` into the
same-sized buffer and `index_copy_` into pages dst_blocks. Everything on the current stream,
serialized: the transfer starts when the prefill has finished, as a host-driven connector does.
Runs unchanged over gloo on CPU workers.
"""

import torch
import torch.distributed as dist

from commweave.workloads.kv_transfer.prefill import PrefillLayers

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    L, KV, D, nb = shape["L"], shape["KV"], shape["D"], shape["blocks"]
    src = ctx.rank - ctx.rank % 2
    state = {"src": src, "dst": src + 1, "is_src": ctx.rank == src,
             "prefill": PrefillLayers(shape, ctx.device) if ctx.rank == src else None,
             "staging": torch.empty(L, 2, nb, 16, KV, D, dtype=torch.bfloat16, device=ctx.device)}
    return state


def run(ctx, state, inputs, out):
    if state["is_src"]:
        for layer in range(out.shape[0]):
            state["prefill"].layer(inputs, out, layer)
        torch.index_select(out, 2, inputs["src_blocks"], out=state["staging"])
        dist.send(state["staging"], group=ctx.group, group_dst=state["dst"])
    else:
        dist.recv(state["staging"], group=ctx.group, group_src=state["src"])
        out.index_copy_(2, inputs["dst_blocks"], state["staging"])
# EVOLVE-BLOCK-END
