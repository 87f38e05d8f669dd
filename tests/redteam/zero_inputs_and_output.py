"""Writes zeros to its output, then zeros its inputs, so a reference computed from the (shared)
inputs after the run would be zeros too. Expected: wrong_result or tampering."""

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {}


def run(ctx, state, inputs, out):
    out.zero_()
    for tensor in inputs.values():
        tensor.zero_()
# EVOLVE-BLOCK-END
