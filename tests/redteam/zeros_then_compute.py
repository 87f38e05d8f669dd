"""Writes zeros (finite: not the poison) into its output, answers at once, and computes the right
result on a thread just after the answer left: a judge that reads the output some time after the
answer (its reference takes longer than the deferred work) sees the late write and times only the
zeros (on CPU at 256^3 this passed at 1.3-10x). Expected: wrong_result (the judge stops the
program's processes the moment its answer arrives and reads what existed then)."""

import threading
import time

import torch
import torch.distributed as dist


# EVOLVE-BLOCK-START
def later(state):
    while True:
        time.sleep(0)
        with state["lock"]:
            if state["busy"] or not state["todo"]:
                continue
            todo, state["todo"] = state["todo"], []
        time.sleep(0.00005)  # the answer goes out first
        for full, b, out in todo:
            torch.mm(full, b, out=out)


def setup(ctx, shape):
    state = {"todo": [], "busy": False, "lock": threading.Lock()}
    threading.Thread(target=later, args=(state,), daemon=True).start()
    return state


def run(ctx, state, inputs, out):
    state["busy"] = True
    parts = [torch.empty_like(inputs["a"]) for _ in range(ctx.world_size)]
    dist.all_gather(parts, inputs["a"], group=ctx.group)
    out.zero_()
    with state["lock"]:
        state["todo"].append((torch.cat(parts), inputs["b"].clone(), out))
        state["busy"] = False
# EVOLVE-BLOCK-END
