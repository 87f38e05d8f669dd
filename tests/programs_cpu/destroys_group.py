"""Hostile: destroys the process group after its first correct call (expected: its own later calls
fail, runtime_error; the next program gets fresh processes and passes)."""

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {}


def run(ctx, state, inputs, out):
    parts = [torch.empty_like(inputs["a"]) for _ in range(ctx.world_size)]
    dist.all_gather(parts, inputs["a"], group=ctx.group)
    torch.mm(torch.cat(parts), inputs["b"], out=out)
    dist.destroy_process_group()
# EVOLVE-BLOCK-END
