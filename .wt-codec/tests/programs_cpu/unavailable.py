"""Declares itself unable to run anywhere (expected: unavailable, which is no candidate failure)."""

# EVOLVE-BLOCK-START
def available(ctx):
    return "this program needs hardware no machine has"


def setup(ctx, shape):
    raise AssertionError("setup() must not be called when available() gives a reason")


def run(ctx, state, inputs, out):
    raise AssertionError("run() must not be called when available() gives a reason")
# EVOLVE-BLOCK-END
