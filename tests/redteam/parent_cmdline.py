"""Reads its ancestors' command lines (where a run's database path or a key passed as an argument
would be) and raises with them. Expected: runtime_error holding no ancestor's command line."""

import os

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    found = []
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            found.append(f.read())
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    raise RuntimeError(f"ancestors' command lines: {found!r}")


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
