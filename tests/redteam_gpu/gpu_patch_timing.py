"""Writes nothing and patches what a judge in its process would time and wait with
(torch.cuda.synchronize, Event.elapsed_time/synchronize/query, Stream.synchronize). Expected:
wrong_result (the judge times and checks from its own process)."""

import torch

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.Event.elapsed_time = lambda self, other: 1e-6
    torch.cuda.Event.synchronize = lambda self: None
    torch.cuda.Event.query = lambda self: True
    torch.cuda.Stream.synchronize = lambda self: None
    return {}


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
