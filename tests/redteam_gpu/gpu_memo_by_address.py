"""Memoises its output per input address on the GPU and skips the work on a hit. Expected:
wrong_result (fresh values in the same buffers)."""

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {"memo": {}}


def run(ctx, state, inputs, out):
    key = (inputs["a"].data_ptr(), inputs["b"].data_ptr(), out.data_ptr())
    hit = torch.tensor([int(key in state["memo"])], device=ctx.device)
    dist.all_reduce(hit, op=dist.ReduceOp.MIN, group=ctx.group)
    if hit.item():
        out.copy_(state["memo"][key])
        return
    full = torch.empty(ctx.world_size * inputs["a"].shape[0], inputs["a"].shape[1], device=ctx.device)
    dist.all_gather_into_tensor(full, inputs["a"], group=ctx.group)
    torch.mm(full, inputs["b"], out=out)
    state["memo"][key] = out.clone()
# EVOLVE-BLOCK-END
