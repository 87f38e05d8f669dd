"""Figure: the sweep tables of docs/results.md (sweep-<workload>-*.json): a seed's CONFIG knobs timed beside its baselines.

    python bench/sweep.py gemm-allgather --gpus 4 --shapes 8192x8192x8192 \
        --grid comm_ctas=8,16,32 --grid order=staggered,broadcast
    python bench/sweep.py attention-cp --gpus 2 --program seed_pull --shapes s32768-q32kv8-d128-full \
        --grid chunks=1,2,4

`--program` sweeps another of the workload's programs (default: its seed); the seed is then timed
beside the variants as it is.

Every program is checked for correctness first (check shapes, then each timed shape); the survivors
are timed in one job per shape beside the baselines (`commweave.evaluate.bench.bench_workload`,
the same path as `commweave bench`). Results go to bench/results/ (or --out-dir).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from rich.console import Console

from commweave.contracts.program import with_config
from commweave.evaluate.bench import bench_workload
from commweave.report.bench import notes, ranking_table
from commweave.report.results import RESULTS_DIR, write_results
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
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
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
    with WorkerPool(args.gpus, job_timeout_s=300) as pool:
        report = bench_workload(pool, wl, shapes, {b: wl.program_text(b) for b in wl.baselines} | variants,
                                iters=args.iters, job_timeout_s=300, command=["python", "bench/sweep.py", *sys.argv[1:]],
                                meta={"program": swept, "grid": grid},
                                progress=lambda step: console.print(step.description, highlight=False))
    path = write_results(f"sweep-{wl.name}-{args.gpus}gpu", report.to_json(), out_dir=args.out_dir,
                         provenance=report.provenance)
    console.print(ranking_table(report, f"{wl.name} on {args.gpus} GPUs: median µs (x the fitness baseline)")[0])
    for line in notes(report):
        console.print(line, highlight=False, markup=False)
    console.print(f"results: {path}", highlight=False)


if __name__ == "__main__":
    main()
