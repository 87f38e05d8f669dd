"""Reads /proc/self/environ: the environment of its last exec, which a fork inherits even after
os.environ was cleared. Expected: runtime_error that names no secret."""

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    with open("/proc/self/environ", "rb") as f:
        raise RuntimeError(f"/proc/self/environ: {f.read()!r}")


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
