"""Degrades the process that forks every later program (its parent, the zygote) for the pool's
life: lowest priority, one CPU, at most 16 open files. Expected: runtime_error, and the zygote
untouched (a program process names no process outside its pid namespace)."""

import os
import resource

MARKER = "__MARKER__"

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    parent = os.getppid()
    done = []
    for name, attack in (("renice", lambda: os.setpriority(os.PRIO_PROCESS, parent, 19)),
                         ("pin", lambda: os.sched_setaffinity(parent, {0})),
                         ("prlimit", lambda: resource.prlimit(parent, resource.RLIMIT_NOFILE, (16, 16)))):
        try:
            attack()
            done.append(name)
        except OSError as exc:
            done.append(f"{name} refused ({exc.strerror})")
    raise RuntimeError(f"parent {parent}: {', '.join(done)}")


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
