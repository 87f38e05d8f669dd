"""Kills its own process group (killpg(0)): in a judge that shares its group, that is the judge.
Expected: a failure (its own process died: runtime_error), and a working pool afterwards."""

import os
import signal

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    os.killpg(0, signal.SIGKILL)
    return {}


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
