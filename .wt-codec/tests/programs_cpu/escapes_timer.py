"""Broken: writes `out` from a background thread after run() returns, the CPU analogue of work left
on an unjoined side stream (expected from the benchmark: suspect)."""

import threading
import time

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {"threads": []}


def run(ctx, state, inputs, out):
    parts = [torch.empty_like(inputs["a"]) for _ in range(ctx.world_size)]
    dist.all_gather(parts, inputs["a"], group=ctx.group)
    result = torch.mm(torch.cat(parts), inputs["b"])

    def late_write():
        time.sleep(0.02)
        out.copy_(result)

    thread = threading.Thread(target=late_write)
    thread.start()
    state["threads"].append(thread)


def teardown(ctx, state):
    for thread in state["threads"]:
        thread.join()
# EVOLVE-BLOCK-END
