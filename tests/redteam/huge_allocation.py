"""Asks for 4 TiB of host memory in setup. Expected: runtime_error (the allocation fails), the
machine unharmed."""

import torch

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {"hoard": torch.ones(1 << 40, dtype=torch.float32)}


def run(ctx, state, inputs, out):
    out.zero_()
# EVOLVE-BLOCK-END
