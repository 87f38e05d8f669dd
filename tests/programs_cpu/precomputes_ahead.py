"""Hostile: reads the input sets of the judge's shared block (its tensors are views of it) that its
batch already used (call i uses set i), computes their outputs during each call, and answers a
later call from that table. Where a judge wrote a later batch's values while this one ran, later
calls would hit; its teardown raises if any did (expected: it passes, with no hit, because a
batch's values land only before it starts, while the program is stopped). A batch's own later sets
are there from its start by design: reading them moves no work out of the timed batch."""

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {"ahead": {}, "hits": 0}


def _output(ctx, a, b):
    parts = [torch.empty_like(a) for _ in range(ctx.world_size)]
    dist.all_gather(parts, a, group=ctx.group)
    return torch.mm(torch.cat(parts), b)


def _key(a, b):
    return (a.numpy().tobytes(), b.numpy().tobytes())


def _used_sets(inputs):
    """Every (a, b) pair laid out like this call's before it in the block, found by stepping through it."""
    a, b = inputs["a"], inputs["b"]
    storage = a.untyped_storage()
    def aligned(n):
        return -(-n // 256) * 256
    stride = aligned(a.numel() * 4) + aligned(b.numel() * 4)
    off_a, off_b = a.storage_offset() * 4, b.storage_offset() * 4
    start = off_a % stride
    sets = []
    for base in range(start, off_a, stride):  # the sets this batch already used
        view_a = torch.empty(0).set_(storage, base // 4, a.shape)
        view_b = torch.empty(0).set_(storage, (base + off_b - off_a) // 4, b.shape)
        sets.append((view_a, view_b))
    return sets


def run(ctx, state, inputs, out):
    key = _key(inputs["a"], inputs["b"])
    if key in state["ahead"]:
        state["hits"] += 1
        out.copy_(state["ahead"][key])
    else:
        out.copy_(_output(ctx, inputs["a"], inputs["b"]))
    if out.storage_offset() == 0:
        return  # not the judge's block layout (inputs after the output): nothing to read ahead
    for a, b in _used_sets(inputs):
        state["ahead"][_key(a, b)] = _output(ctx, a, b)


def teardown(ctx, state):
    if state["hits"]:
        raise AssertionError(f"{state['hits']} calls answered from values read ahead")
# EVOLVE-BLOCK-END
