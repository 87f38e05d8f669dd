"""Rank 1 sleeps far past any job timeout while rank 0 returns: one hung rank. Expected: timeout
(or runtime_error on a single rank), and every process of it killed."""

import time

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {}


def run(ctx, state, inputs, out):
    if ctx.rank == ctx.world_size - 1:
        time.sleep(3600)
    out.zero_()
# EVOLVE-BLOCK-END
