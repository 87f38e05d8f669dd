"""Host baseline (c): gather, NCCL send/recv and scatter layer by layer, overlapped with the
prefill compute.

Source: layer l's stand-in prefill (P GEMMs [S, 4096] x [4096, 4096]) and reshape_and_cache run on
the current stream; an event then lets a side stream gather layer l's pages into its slice of a
contiguous buffer and `dist.send` it (NCCL orders the send after the side stream), while the
current stream goes on with layer l + 1. Destination: `dist.recv` of layer l on a side stream,
then its scatter into pages dst_blocks on the current stream, overlapping the receipt of layer
l + 1. On CPU workers (gloo, no streams) the same steps run in order.
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
             "staging": torch.empty(L, 2, nb, 16, KV, D, dtype=torch.bfloat16, device=ctx.device),
             "comm": ctx.stream("kv_comm") if ctx.is_cuda else None}
    return state


def run(ctx, state, inputs, out):
    comm, staging = state["comm"], state["staging"]
    main = torch.cuda.current_stream(ctx.device) if comm is not None else None
    if comm is not None:
        comm.wait_stream(main)  # the previous call's uses of `staging` and `out` are done
    for layer in range(out.shape[0]):
        if state["is_src"]:
            state["prefill"].layer(inputs, out, layer)
            if comm is None:
                torch.index_select(out[layer], 1, inputs["src_blocks"], out=staging[layer])
                dist.send(staging[layer], group=ctx.group, group_dst=state["dst"])
                continue
            comm.wait_stream(main)
            with torch.cuda.stream(comm):
                torch.index_select(out[layer], 1, inputs["src_blocks"], out=staging[layer])
                dist.send(staging[layer], group=ctx.group, group_dst=state["dst"])
        else:
            if comm is None:
                dist.recv(staging[layer], group=ctx.group, group_src=state["src"])
                out[layer].index_copy_(1, inputs["dst_blocks"], staging[layer])
                continue
            with torch.cuda.stream(comm):
                dist.recv(staging[layer], group=ctx.group, group_src=state["src"])
            main.wait_stream(comm)
            out[layer].index_copy_(1, inputs["dst_blocks"], staging[layer])
    if comm is not None:
        main.wait_stream(comm)
# EVOLVE-BLOCK-END
