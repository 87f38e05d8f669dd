"""Puts its own threads under SCHED_FIFO (real-time: no other process of the machine runs on their
cores while they compute), then computes honestly. Expected: refused (runtime_error; a program
process has no capability and RLIMIT_RTPRIO 0)."""

import os
import threading

import torch
import torch.distributed as dist

MARKER = "__MARKER__"

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    raised = []
    for tid in [threading.get_native_id(), *(t.native_id for t in threading.enumerate() if t.native_id)]:
        try:
            os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(1))
            raised.append(tid)
        except OSError as exc:
            raise RuntimeError(f"SCHED_FIFO refused: {exc}") from None
    raise RuntimeError(f"{MARKER}-got SCHED_FIFO on threads {raised}")


def run(ctx, state, inputs, out):
    parts = [torch.empty_like(inputs["a"]) for _ in range(ctx.world_size)]
    dist.all_gather(parts, inputs["a"], group=ctx.group)
    torch.mm(torch.cat(parts), inputs["b"], out=out)
# EVOLVE-BLOCK-END
