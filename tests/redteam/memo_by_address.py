"""Memoises its output per input set (keyed by the inputs' addresses) and skips the work on a hit:
fast when a judge reuses buffers without fresh values. Expected: wrong_result."""

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {"memo": {}}


def run(ctx, state, inputs, out):
    key = (inputs["a"].data_ptr(), inputs["b"].data_ptr(), out.data_ptr())
    hit = torch.tensor([int(key in state["memo"])])
    dist.all_reduce(hit, op=dist.ReduceOp.MIN, group=ctx.group)  # skip only where every rank has it
    if hit.item():
        out.copy_(state["memo"][key])
        return
    parts = [torch.empty_like(inputs["a"]) for _ in range(ctx.world_size)]
    dist.all_gather(parts, inputs["a"], group=ctx.group)
    torch.mm(torch.cat(parts), inputs["b"], out=out)
    state["memo"][key] = out.clone()
# EVOLVE-BLOCK-END
