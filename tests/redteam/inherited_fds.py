"""Lists the descriptors it inherited (/proc/self/fd) and reads every file behind them, looking
for the run's database or anything else of the judge's left open across the fork. Expected:
runtime_error naming nothing of the run (only its own channel and buffers are open)."""

import os

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        found[fd] = target
        if target.startswith("/") and os.path.isfile(target):
            try:
                found[target] = os.pread(int(fd), 4096, 0)
            except OSError:
                pass
    raise RuntimeError(f"inherited descriptors: {found!r}")


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
