"""Starts a child in a session of its own (out of its process group, so a killpg misses it) that
sleeps with a marker in its command line, then computes honestly. Expected: tampering, and the
child killed."""

import subprocess
import sys

import torch
import torch.distributed as dist

MARKER = "__MARKER__"

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    child = subprocess.Popen([sys.executable, "-c", f"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                              f"time.sleep(120)  # {MARKER}"], start_new_session=True)
    return {"child": child}


def run(ctx, state, inputs, out):
    parts = [torch.empty_like(inputs["a"]) for _ in range(ctx.world_size)]
    dist.all_gather(parts, inputs["a"], group=ctx.group)
    torch.mm(torch.cat(parts), inputs["b"], out=out)
# EVOLVE-BLOCK-END
