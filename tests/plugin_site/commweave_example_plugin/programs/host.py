# EVOLVE-BLOCK-START
import torch
import torch.distributed as dist


def setup(ctx, shape):
    return None


def run(ctx, state, inputs, out):
    out.copy_(inputs["x"])
    if ctx.world_size > 1:
        dist.all_reduce(out, group=ctx.group)
    out.mul_(torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-6)).mul_(inputs["g"])
# EVOLVE-BLOCK-END
