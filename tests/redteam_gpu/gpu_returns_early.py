"""Queues the whole computation on a side stream it never joins back and returns at once: the
timer's stream sees nothing to wait for. Expected: suspect (not ready when the timer stopped) or
wrong_result."""

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {"side": torch.cuda.Stream(ctx.device)}


def run(ctx, state, inputs, out):
    side = state["side"]
    side.wait_stream(torch.cuda.current_stream(ctx.device))
    with torch.cuda.stream(side):
        full = torch.empty(ctx.world_size * inputs["a"].shape[0], inputs["a"].shape[1], device=ctx.device)
        dist.all_gather_into_tensor(full, inputs["a"], group=ctx.group)
        for _ in range(20):  # long enough to outlast the return
            torch.mm(full, inputs["b"], out=out)
# EVOLVE-BLOCK-END
