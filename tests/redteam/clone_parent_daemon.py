"""Starts a daemon with clone(CLONE_PARENT): a sibling, not a child, so a walk of its own tree
misses it, in a session of its own (a group kill misses it too); it sleeps with a marker in its
command line. Expected: a failure, and the daemon killed with the program (it is in the
program's pid namespace)."""

import ctypes
import os
import platform
import sys

MARKER = "__MARKER__"
CLONE_PARENT, SIGCHLD = 0x00008000, 17

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    libc = ctypes.CDLL(None, use_errno=True)
    number = 56 if platform.machine() == "x86_64" else 220  # clone
    pid = libc.syscall(ctypes.c_long(number), ctypes.c_ulong(CLONE_PARENT | SIGCHLD), None, None, None, None)
    if pid == 0:
        os.setsid()  # out of its process group too
        os.execv(sys.executable, [sys.executable, "-c", f"import time; time.sleep(120)  # {MARKER}"])
    if pid < 0:
        raise RuntimeError(f"clone(CLONE_PARENT) refused: {os.strerror(ctypes.get_errno())}")
    raise RuntimeError(f"left daemon {pid} as a sibling")


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
