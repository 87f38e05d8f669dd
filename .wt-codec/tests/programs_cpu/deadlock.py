"""Broken: rank 0 waits in a barrier the other ranks never enter (expected: timeout)."""

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {}


def run(ctx, state, inputs, out):
    if ctx.rank == 0:
        ctx.barrier()
# EVOLVE-BLOCK-END
