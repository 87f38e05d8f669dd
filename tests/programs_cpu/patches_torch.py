"""Hostile: computes its own output correctly, then replaces torch.mm with one that returns zeros
and slows down (expected: the baseline beside it and every later program are unaffected, since
they run in processes of their own)."""

import time

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {}


def run(ctx, state, inputs, out):
    parts = [torch.empty_like(inputs["a"]) for _ in range(ctx.world_size)]
    dist.all_gather(parts, inputs["a"], group=ctx.group)
    torch.mm(torch.cat(parts), inputs["b"], out=out)
    if not getattr(torch.mm, "patched", False):
        original = torch.mm

        def sabotaged(a, b, out=None):
            time.sleep(0.01)
            return original(a, b, out=out).zero_()

        sabotaged.patched = True
        torch.mm = sabotaged
# EVOLVE-BLOCK-END
