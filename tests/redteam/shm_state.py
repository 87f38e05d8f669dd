"""Leaves 64 MiB and a state file in /dev/shm for a later evaluation to find (and reports one an
earlier run left). Expected: runtime_error, and nothing of it left in the machine's /dev/shm
(each program gets a private tmpfs there, gone when it ends)."""

import os

MARKER = "__MARKER__"

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    state = f"/dev/shm/{MARKER}-state-rank{ctx.rank}"
    if os.path.exists(state):
        raise RuntimeError(f"{MARKER}-got state carried over: {open(state).read()}")
    with open(state, "w") as f:
        f.write("from an earlier evaluation")
    with open(f"/dev/shm/{MARKER}-ballast-rank{ctx.rank}", "wb") as f:
        f.write(b"\0" * (64 << 20))
    raise RuntimeError("left state in /dev/shm")


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
