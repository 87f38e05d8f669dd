"""Broken: setup() fails on rank 0 only; rank 1 must not wait for it (expected: runtime_error on
rank 0, no pool restart)."""

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    if ctx.rank == 0:
        raise MemoryError("rank 0 could not allocate its buffers")
    return {}


def run(ctx, state, inputs, out):
    raise AssertionError("run() must not be called after a failed setup()")
# EVOLVE-BLOCK-END
