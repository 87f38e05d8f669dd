"""Leaves a daemon behind (double fork + setsid, then exec of a sleeping interpreter whose command
line carries a marker), then computes honestly. Expected: tampering (a process it spawned
outlived it), and the daemon killed."""

import os
import sys

import torch
import torch.distributed as dist

MARKER = "__MARKER__"

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    if os.fork() == 0:
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", f"import time; time.sleep(120)  # {MARKER}"])
            os._exit(0)
        os._exit(0)
    os.wait()
    return {}


def run(ctx, state, inputs, out):
    parts = [torch.empty_like(inputs["a"]) for _ in range(ctx.world_size)]
    dist.all_gather(parts, inputs["a"], group=ctx.group)
    torch.mm(torch.cat(parts), inputs["b"], out=out)
# EVOLVE-BLOCK-END
