"""Returns at once and lets a thread write the (right) result a few milliseconds later: the CPU
form of work left running after the timed region. Expected: wrong_result (output not written
when checked) or suspect (not ready when the timer stopped)."""

import threading
import time

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {}


def run(ctx, state, inputs, out):
    parts = [torch.empty_like(inputs["a"]) for _ in range(ctx.world_size)]
    dist.all_gather(parts, inputs["a"], group=ctx.group)
    full, b = torch.cat(parts), inputs["b"].clone()

    def late():
        time.sleep(0.02)
        torch.mm(full, b, out=out)

    threading.Thread(target=late, daemon=True).start()
# EVOLVE-BLOCK-END
