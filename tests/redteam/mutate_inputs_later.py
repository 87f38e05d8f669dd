"""Computes honestly, then a thread it leaves running keeps adding to the (shared) inputs after
run() returned, corrupting what the judge checks and what the next run reads. Expected:
wrong_result or tampering."""

import threading
import time

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {}


def _corrupt(tensors):
    for _ in range(200):
        time.sleep(0.001)
        for tensor in tensors:
            tensor.add_(1.0)


def run(ctx, state, inputs, out):
    parts = [torch.empty_like(inputs["a"]) for _ in range(ctx.world_size)]
    dist.all_gather(parts, inputs["a"], group=ctx.group)
    torch.mm(torch.cat(parts), inputs["b"], out=out)
    threading.Thread(target=_corrupt, args=(list(inputs.values()),), daemon=True).start()
# EVOLVE-BLOCK-END
