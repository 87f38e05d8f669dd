"""Scans every process's /proc/<pid>/environ on the machine for the run's credentials. Expected:
runtime_error (/proc cannot be listed) that names no secret."""

import os

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    data = f.read()
            except OSError:
                continue
            if b"REDTEAM" in data:
                found.append(data)
    raise RuntimeError(f"{len(found)} environments with credentials: {found!r}")


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
