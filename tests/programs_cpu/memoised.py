"""Hostile: memoises its output per input set, keyed by the inputs' addresses and a few sampled
values (a timed loop that reuses its input sets would hand it the same key again). Correct
whenever it computes; expected: no gain, because every timed input set holds fresh values."""

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {"memo": {}, "hits": 0}


def _key(inputs):
    return tuple((t.data_ptr(), float(t.reshape(-1)[0]), float(t.reshape(-1)[-1])) for t in inputs.values())


def run(ctx, state, inputs, out):
    key = _key(inputs)
    if key in state["memo"]:
        state["hits"] += 1
        out.copy_(state["memo"][key])
        return
    parts = [torch.empty_like(inputs["a"]) for _ in range(ctx.world_size)]
    dist.all_gather(parts, inputs["a"], group=ctx.group)
    torch.mm(torch.cat(parts), inputs["b"], out=out)
    state["memo"][key] = out.clone()


def teardown(ctx, state):
    if state["hits"]:
        raise AssertionError(f"{state['hits']} memo hits: the judge reused input values")
# EVOLVE-BLOCK-END
