"""Hostile: replays the output it computed for the same input addresses (expected in a benchmark:
wrong_result, since every timed input set holds fresh values and the judge verifies outputs)."""

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {"memo": {}}


def run(ctx, state, inputs, out):
    key = tuple(t.data_ptr() for t in inputs.values())
    if key in state["memo"]:
        out.copy_(state["memo"][key])
        return
    parts = [torch.empty_like(inputs["a"]) for _ in range(ctx.world_size)]
    dist.all_gather(parts, inputs["a"], group=ctx.group)
    torch.mm(torch.cat(parts), inputs["b"], out=out)
    state["memo"][key] = out.clone()
# EVOLVE-BLOCK-END
