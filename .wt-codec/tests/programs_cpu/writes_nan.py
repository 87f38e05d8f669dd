"""Broken: one NaN in an otherwise correct output on the last rank (expected: nan)."""

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {}


def run(ctx, state, inputs, out):
    parts = [torch.empty_like(inputs["a"]) for _ in range(ctx.world_size)]
    dist.all_gather(parts, inputs["a"], group=ctx.group)
    torch.mm(torch.cat(parts), inputs["b"], out=out)
    if ctx.rank == ctx.world_size - 1:
        out[-1, -1] = float("nan")
# EVOLVE-BLOCK-END
