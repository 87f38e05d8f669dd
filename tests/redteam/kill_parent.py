"""Kills its parent (the judge, or whatever started it) with SIGKILL during setup. Expected: a
failure (refused: runtime_error; or the judge died: tampering), and the next program judged on a
working pool."""

import os
import signal

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    os.kill(os.getppid(), signal.SIGKILL)
    raise RuntimeError("killed the parent")


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
