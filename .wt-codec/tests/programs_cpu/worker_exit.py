"""Broken: rank 1's process dies mid-run (expected: runtime_error, the worker pool restarted)."""

import os

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {}


def run(ctx, state, inputs, out):
    if ctx.rank == 1:
        os._exit(7)
# EVOLVE-BLOCK-END
