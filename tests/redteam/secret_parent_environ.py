"""Walks up its ancestors (the judge, the pool, the search) and reads each one's
/proc/<pid>/environ. Expected: runtime_error that names no secret (refused at the first)."""

import os

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    found = []
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/environ", "rb") as f:
            found.append(f.read())
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    raise RuntimeError(f"ancestors' environments: {found!r}")


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
