"""Asks for 4 TiB of GPU memory in setup. Expected: runtime_error (out of memory), the GPU and the
pool unharmed."""

import torch

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {"hoard": torch.empty(1 << 42, dtype=torch.uint8, device=ctx.device)}


def run(ctx, state, inputs, out):
    out.zero_()
# EVOLVE-BLOCK-END
