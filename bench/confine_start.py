"""Figure: bench/results/confine-start-*.json, what each optional confinement piece adds to starting one program process.

    PYTHONPATH=src python bench/confine_start.py --reps 8

Starts one program process (a world of one, on CPU) from the judge's zygote under no optional
confinement, each piece alone (network namespace, Landlock, pid namespace, private /dev/shm,
dropped privileges) and all this machine offers, in turn, `--reps` rounds; per variant the median
of: spawn until the process says it is ready (confined, its process group up), and the
confinement's own share as the process measured it (`confine_s`). The pid namespace's cost is
not in `confine_s`: it is the extra fork of the namespace's init, from the zygote.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from commweave.evaluate.jobs import SERVE
from commweave.report.results import write_results
from commweave.runtime.candidate import (Confinement, ProgramProcess, confinement, make_rendezvous,
                                         remove_rendezvous)

VARIANTS = {"none": Confinement(False, False), "network namespace": Confinement(True, False),
            "Landlock": Confinement(False, True), "pid namespace": Confinement(False, False, pid_namespace=True),
            "private /dev/shm": Confinement(False, False, shm=True),
            "privileges dropped": Confinement(False, False, privileges=True)}


def started(rules: Confinement) -> tuple[float, float]:
    """(seconds from spawn to ready, the confinement's share as the process measured it)."""
    rendezvous = make_rendezvous()
    try:
        began = time.perf_counter()
        proc = ProgramProcess.spawn(rank=0, world_size=1, device="cpu", rendezvous=rendezvous, serve=SERVE, rules=rules)
        proc.await_ready(time.monotonic() + 60, lambda: False)
        ready = time.perf_counter() - began
        proc.close()
        return ready, float(proc.ready.get("confine_s", 0.0))
    finally:
        remove_rendezvous(rendezvous)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=8)
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    offered = confinement("cpu", SERVE)
    variants = {**VARIANTS, "all offered": offered}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(args.reps):
        for name, rules in variants.items():
            times[name].append(started(rules))
    rows = {name: {"ready_ms": statistics.median(t[0] for t in runs) * 1e3,
                   "confine_ms": statistics.median(t[1] for t in runs) * 1e3} for name, runs in times.items()}
    path = write_results("confine-start-cpu", {"reps": args.reps, "offered": str(offered), "variants": rows},
                         command=["python", "bench/confine_start.py", *sys.argv[1:]])
    for name, row in rows.items():
        print(f"{name:20s} ready {row['ready_ms']:6.1f} ms   confinement's share {row['confine_ms']:5.1f} ms")
    print(path)


if __name__ == "__main__":
    main()
