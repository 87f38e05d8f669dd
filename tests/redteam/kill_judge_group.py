"""Kills its parent's whole process group (the judge's, and whoever shares it) with SIGKILL.
Expected: a failure (refused: runtime_error; or tampering), and a working pool afterwards."""

import os
import signal

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
    raise RuntimeError("killed the judge's process group")


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
