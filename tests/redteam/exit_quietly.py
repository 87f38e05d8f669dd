"""Ends its own process with exit status 0 in the middle of run(), as if all were well. Expected:
runtime_error (its process died), the pool fine."""

import os

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {}


def run(ctx, state, inputs, out):
    out.zero_()
    os._exit(0)
# EVOLVE-BLOCK-END
