"""Yardstick, not a transfer: one contiguous copy-engine copy of the source's new K/V (the bytes a
transfer moves, less a partial last page's padding) into the start of the destination's cache
(`ctx.peer_tensor`, one `copy_` over NVLink). What the link gives a single copy of this size,
latency included: the physical reference for a transfer's effective GB/s at small sizes, where
394 GB/s (a large copy's rate) is out of any call's reach. Stand-in prefill skipped; no barrier,
so the destination's cache is not a result (timed in the same job, never checked).
"""

import torch

# EVOLVE-BLOCK-START
CONFIG = dict()


def available(ctx):
    return None if ctx.is_cuda else "the copy engine's peer copy needs CUDA GPUs"


def setup(ctx, shape):
    return {"is_src": ctx.rank % 2 == 0, "peer": ctx.rank ^ 1}


def run(ctx, state, inputs, out):
    if state["is_src"]:
        kv = inputs["kv"]
        ctx.peer_tensor(out, state["peer"]).view(-1)[: kv.numel()].copy_(kv.view(-1))
# EVOLVE-BLOCK-END
