"""Correct toy program that keeps 4 forked helper processes (busy, 64 MiB each, in its session) alive until
it is killed: the judge must not read helpers still dying at close as processes that escaped."""

import os
import time

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    helpers = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:
            held = bytearray(64 << 20)  # a working set of its own: slower to tear down
            held[::4096] = b"x" * len(held[::4096])
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                sum(range(1000))
            os._exit(0)
        helpers.append(pid)
    return {"helpers": helpers}


def run(ctx, state, inputs, out):
    parts = [torch.empty_like(inputs["a"]) for _ in range(ctx.world_size)]
    dist.all_gather(parts, inputs["a"], group=ctx.group)
    torch.mm(torch.cat(parts), inputs["b"], out=out)
# EVOLVE-BLOCK-END
