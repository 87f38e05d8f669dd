"""Closes every file descriptor above 2 (its channel to the judge, the process group's sockets)
and then returns the right-looking zeros. Expected: runtime_error, the pool fine."""

import os

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {}


def run(ctx, state, inputs, out):
    out.zero_()
    os.closerange(3, 4096)
# EVOLVE-BLOCK-END
