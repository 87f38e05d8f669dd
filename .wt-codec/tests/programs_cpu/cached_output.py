"""Broken: computes the first call correctly, then replays that result (expected: wrong_result on
the second seed)."""

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {"cached": None}


def run(ctx, state, inputs, out):
    if state["cached"] is None:
        parts = [torch.empty_like(inputs["a"]) for _ in range(ctx.world_size)]
        dist.all_gather(parts, inputs["a"], group=ctx.group)
        state["cached"] = torch.mm(torch.cat(parts), inputs["b"])
    out.copy_(state["cached"])
# EVOLVE-BLOCK-END
