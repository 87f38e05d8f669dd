"""Lists the open files of its ancestors (/proc/<pid>/fd: the database, the judge's sockets and
shared memory) and reads through them. Expected: runtime_error naming none of them."""

import os

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    found = {}
    pid = os.getppid()
    while pid > 1:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            found[f"{pid}/{fd}"] = target
            if target.endswith(".sqlite"):
                with open(f"/proc/{pid}/fd/{fd}", "rb") as f:
                    found[target] = f.read(4096)
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    raise RuntimeError(f"ancestors' files: {found!r}")


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
