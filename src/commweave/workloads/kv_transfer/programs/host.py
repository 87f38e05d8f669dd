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

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    L, KV, D, nb = shape["L"], shape["KV"], shape["D"], shape["blocks"]
    src = ctx.rank - ctx.rank % 2
    state = {"src": src, "dst": src + 1, "is_src": ctx.rank == src, "passes": shape["P"],
             "staging": torch.empty(L, 2, nb, 16, KV, D, dtype=torch.bfloat16, device=ctx.device),
             "tail": torch.zeros(2, 1, 16, KV, D, dtype=torch.bfloat16, device=ctx.device)}
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
        torch.index_select(out, 2, inputs["src_blocks"], out=state["staging"])
        dist.send(state["staging"], state["dst"], group=ctx.group)
    else:
        dist.recv(state["staging"], state["src"], group=ctx.group)
        out.index_copy_(2, inputs["dst_blocks"], state["staging"])
# EVOLVE-BLOCK-END
