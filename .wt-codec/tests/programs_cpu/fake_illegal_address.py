"""Broken: raises the message CUDA gives for a bad pointer, so the CPU suite can exercise the
sticky-error path (expected: illegal_address, the worker pool restarted)."""

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {}


def run(ctx, state, inputs, out):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")
# EVOLVE-BLOCK-END
