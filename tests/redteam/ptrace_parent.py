"""Attaches to its parent with ptrace (PTRACE_SEIZE: the parent keeps running) as the first step to
reading or rewriting the judge's memory, and detaches at once if that worked (reported with the
marker). Expected: runtime_error (refused)."""

import ctypes
import os

MARKER = "__MARKER__"

# EVOLVE-BLOCK-START
PTRACE_SEIZE, PTRACE_DETACH = 0x4206, 17


def setup(ctx, shape):
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getppid()
    if libc.ptrace(PTRACE_SEIZE, parent, None, None) == 0:
        libc.ptrace(PTRACE_DETACH, parent, None, None)
        raise RuntimeError(f"{MARKER}-got ptrace on the parent {parent}")
    raise OSError(ctypes.get_errno(), f"ptrace on the parent: {os.strerror(ctypes.get_errno())}")


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
