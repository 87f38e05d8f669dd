"""Sweep a workload seed's CONFIG knobs on the GPU machine, side by side with its baselines.

    python bench/sweep.py gemm-allgather --gpus 4 --shapes 8192x8192x8192 \
        --grid comm_ctas=8,16,32 --grid order=staggered,broadcast
    python bench/sweep.py attention-cp --gpus 2 --program seed_pull --shapes s32768-q32kv8-d128-full \
        --grid chunks=1,2,4

`--program` sweeps another of the workload's programs (default: its seed); the seed is then timed
beside the variants as it is.

Every variant is checked for correctness first (check shapes and the timed shapes); the survivors
are timed in one job per shape beside the baselines. Results go to bench/results/.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from commweave.evaluate.evaluator import Evaluator
from commweave.evaluate.floor import calibrate
from commweave.evaluate.program import with_config
from commweave.report.results import write_results
from commweave.runtime import WorkerPool, apply_safe_env
from commweave.workloads import get_workload


def _literal(text: str) -> object:
    """'16' -> 16, 'true'/'false' -> bool, anything else stays a string."""
    if text.lstrip("-").isdigit():
        return int(text)
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_grid(items: list[str]) -> dict[str, list[object]]:
    grid: dict[str, list[object]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        if not sep or not values:
            raise SystemExit(f"--grid {item!r}: expected knob=v1,v2,...")
        grid[name] = [_literal(v) for v in values.split(",")]
    return grid


def main() -> None:
    apply_safe_env()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload")
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--shapes", nargs="+", required=True)
    parser.add_argument("--grid", action="append", default=[], help="knob=v1,v2 (repeatable)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--program", default=None, help="the workload program whose CONFIG is swept (default: the seed)")
    args = parser.parse_args()

    wl = get_workload(args.workload)
    shapes = [wl.parse_shape(s, args.gpus) for s in args.shapes]
    grid = parse_grid(args.grid)
    swept = args.program or wl.seed
    swept_text = wl.program_text(swept)
    variants = {
        ",".join(f"{k}={v}" for k, v in zip(grid, combo)): with_config(swept_text, **dict(zip(grid, combo)))
        for combo in itertools.product(*grid.values())
    } or {swept: swept_text}
    if swept != wl.seed:
        variants[wl.seed] = wl.program_text(wl.seed)
    console = Console()
    rows = []
    with WorkerPool(args.gpus, job_timeout_s=300) as pool:
        rates = calibrate(pool)
        ev = Evaluator(pool, wl, seeds=2, iters=args.iters, rates=rates, job_timeout_s=300)
        checks = {name: ev.check(text, [*wl.check_shapes(args.gpus), *shapes]) for name, text in variants.items()}
        for name, verdict in checks.items():
            if not verdict.ok:
                console.print(f"{name}: {verdict.failure}: {verdict.message}", highlight=False)
        programs = {b: wl.program_text(b) for b in wl.baselines}
        programs |= {name: text for name, text in variants.items() if checks[name].ok}
        for shape in shapes:
            result = ev.benchmark(programs, shape)
            rows.append(asdict(result))
            table = Table(title=f"{wl.name} {shape} on {args.gpus} GPUs (floor {result.floor_us:,.1f} µs)")
            for col in ("program", "median µs", "p90 µs", f"vs {wl.baselines[0]}", "verdict"):
                table.add_column(col)
            base = result.programs[wl.baselines[0]].median_us
            for name, t in result.programs.items():
                speed = f"{base / t.median_us:.2f}x" if base and t.median_us and t.verdict.ok else "-"
                med = f"{t.median_us:,.1f}" if t.median_us else "-"
                p90 = f"{t.p90_us:,.1f}" if t.p90_us else "-"
                table.add_row(name, med, p90, speed, "ok" if t.verdict.ok else f"{t.verdict.failure}: {t.verdict.message[:60]}")
            console.print(table)
    path = write_results(f"sweep-{wl.name}-{args.gpus}gpu", {
        "workload": wl.name, "gpus": args.gpus, "program": swept, "grid": grid, "rates": asdict(rates),
        "checks": {n: asdict(v) for n, v in checks.items()}, "benchmarks": rows,
    }, command=["python", "bench/sweep.py", *sys.argv[1:]])
    console.print(f"results: {path}")


if __name__ == "__main__":
    main()
