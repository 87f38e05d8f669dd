"""Sweep the kv-transfer seed's push kernel (CTAs x threads x unroll) on the GPU machine.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src:tests \\
        python bench/sweep_kv.py --gpus 2

Default grid: ctas 32,64,96,132 x threads 256,512,1024 x unroll 2,4,8 (36 variants) on S2048 and
S16384; any CONFIG knob can be swept instead (`--grid prefill_ctas=8,16,32 --shapes S2048-P13`)
or fixed (`--set graph=false`). Every variant's CUDA is compiled first (in parallel, into the
cache the workers read), then checked for correctness on the check shapes plus a transfer-only
shape with more pages than CTAs; the survivors are timed per shape in batches, each batch beside
the host baselines (`host`, `host_layerwise`; `host_per_block` takes a second a call at S16384).
Every benchmark also judges each program's last output bit-exactly. The table at the end lists
each variant's median µs and GB/s per shape, best first. Results go to bench/results/ (or
--out-dir), also when the run is cut short by SIGTERM (then `complete` is false).
"""

from __future__ import annotations

import argparse
import itertools
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import parse_grid  # noqa: E402  (bench/ is not a package)

from commweave.evaluate.evaluator import Evaluator  # noqa: E402
from commweave.evaluate.floor import calibrate  # noqa: E402
from commweave.evaluate.program import load_program, with_config  # noqa: E402
from commweave.report.results import RESULTS_DIR, write_results  # noqa: E402
from commweave.runtime import WorkerPool, apply_safe_env  # noqa: E402
from commweave.runtime.compile import compile_cubin  # noqa: E402
from commweave.workloads import get_workload  # noqa: E402

DEFAULT_GRID = ["ctas=32,64,96,132", "threads=256,512,1024", "unroll=2,4,8"]
EXTRA_CHECK_SHAPE = "S2000-L4-F7"  # 1000 pages over 4 layers, all 8 heads: more pages than CTAs, free blocks


def variants_of(seed_text: str, grid: dict[str, list[Any]], fixed: dict[str, Any]) -> dict[str, str]:
    """'knob=v,...' -> the seed with those CONFIG values (plus `fixed`)."""
    out = {}
    for combo in itertools.product(*grid.values()):
        knobs = dict(zip(grid, combo))
        out[",".join(f"{k}={v}" for k, v in knobs.items())] = with_config(seed_text, **fixed, **knobs)
    return out


def precompile(variants: dict[str, str], console: Console) -> None:
    """Compile each distinct CUDA source the variants' setup() will compile, in parallel."""
    sources = {load_program(text, name).cuda_source() for name, text in variants.items()}
    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(16, len(sources))) as pool:
        list(pool.map(compile_cubin, sources))
    console.print(f"compiled {len(sources)} CUDA sources in {time.perf_counter() - began:.0f} s", highlight=False)


def batches(names: list[str], size: int) -> list[list[str]]:
    return [names[i:i + size] for i in range(0, len(names), size)]


def summary_rows(wl: Any, gpus: int, benchmarks: list[dict], baselines: list[str]) -> list[dict]:
    """One row per (program, shape): median µs, GB/s of the moved pages, and speed-up over the best
    baseline timed in the same batch."""
    rows = []
    for bench in benchmarks:
        shape = wl.parse_shape(bench["shape"], gpus)
        moved = wl.cost(shape, gpus).comm_bytes
        timed = {n: p["median_us"] for n, p in bench["programs"].items() if p["median_us"] and p["verdict"]["ok"]}
        best_base = min((timed[b] for b in baselines if b in timed), default=None)
        for name, prog in bench["programs"].items():
            if name in baselines and any(r["program"] == name and r["shape"] == bench["shape"] for r in rows):
                continue  # a baseline is timed in every batch; keep its first timing
            us = timed.get(name)
            rows.append({
                "program": name, "shape": bench["shape"], "median_us": us,
                "gbps": moved / (us * 1e-6) / 1e9 if us else None,
                "vs_best_baseline": best_base / us if us and best_base else None,
                "verdict": "ok" if prog["verdict"]["ok"] else f"{prog['verdict']['failure']}: {prog['verdict']['message'][:80]}",
            })
    return rows


def print_table(console: Console, rows: list[dict], shapes: list[str], baselines: list[str], top: int) -> None:
    by_program: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_program.setdefault(row["program"], {})[row["shape"]] = row
    last = shapes[-1]

    def key(name: str) -> float:
        us = by_program[name].get(last, {}).get("median_us")
        return us if us else float("inf")

    variants = sorted((n for n in by_program if n not in baselines), key=key)
    table = Table(title=f"kv-transfer seed sweep: median µs (GB/s, x best baseline); sorted by {last}")
    table.add_column("program")
    for shape in shapes:
        table.add_column(shape, justify="right")
    for name in [*baselines, *variants[:top]]:
        cells = []
        for shape in shapes:
            row = by_program.get(name, {}).get(shape)
            if row is None:
                cells.append("-")
            elif row["median_us"] is None:
                cells.append(row["verdict"][:30])
            else:
                ratio = f", {row['vs_best_baseline']:.2f}x" if name not in baselines and row["vs_best_baseline"] else ""
                cells.append(f"{row['median_us']:,.0f} ({row['gbps']:.0f}{ratio})")
        table.add_row(name, *cells)
    console.print(table)
    if len(variants) > top:
        console.print(f"({len(variants) - top} slower variants in the results file)")


def main() -> None:
    apply_safe_env()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--shapes", nargs="+", default=["S2048", "S16384"])
    parser.add_argument("--grid", action="append", default=[], help=f"knob=v1,v2 (repeatable; default {' '.join(DEFAULT_GRID)})")
    parser.add_argument("--set", action="append", default=[], dest="fixed", help="knob=value fixed in every variant")
    parser.add_argument("--baselines", default="host,host_layerwise", help="comma-separated, timed in every batch")
    parser.add_argument("--batch", type=int, default=6, help="variants per benchmark job (memory: one cache each)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-check", action="store_true", help="skip the check phase (benchmarks still judge outputs)")
    parser.add_argument("--top", type=int, default=15, help="variants shown in the final table")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    if args.batch < 1:
        raise SystemExit("--batch must be >= 1")

    wl = get_workload("kv-transfer")
    shapes = [wl.parse_shape(s, args.gpus) for s in args.shapes]
    grid = parse_grid(args.grid or DEFAULT_GRID)
    fixed = {name: values[0] for name, values in parse_grid(args.fixed).items()}
    if any(len(values) != 1 for values in parse_grid(args.fixed).values()) or set(fixed) & set(grid):
        raise SystemExit("--set takes one value per knob, and a knob is either swept (--grid) or set (--set)")
    baselines = [b for b in args.baselines.split(",") if b]
    unknown = sorted(set(baselines) - set(wl.program_names()))
    if unknown:
        raise SystemExit(f"unknown baseline {', '.join(unknown)} (programs: {', '.join(wl.program_names())})")
    variants = variants_of(wl.program_text(wl.seed), grid, fixed)  # with_config refuses unknown knobs
    console = Console()
    console.print(f"{len(variants)} variants x {len(shapes)} shapes on {args.gpus} GPUs, batches of {args.batch}",
                  highlight=False)
    precompile(variants, console)

    record: dict[str, Any] = {"workload": wl.name, "gpus": args.gpus, "grid": grid, "fixed": fixed,
                              "baselines": baselines, "complete": False, "checks": {}, "benchmarks": []}

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    with WorkerPool(args.gpus, job_timeout_s=300) as pool:
        try:
            rates = calibrate(pool)
            record["rates"] = asdict(rates)
            ev = Evaluator(pool, wl, seeds=2, warmup=args.warmup, iters=args.iters, rates=rates, job_timeout_s=300)
            passed = list(variants)
            if not args.no_check:
                check_shapes = [*wl.check_shapes(args.gpus), wl.parse_shape(EXTRA_CHECK_SHAPE, args.gpus)]
                began = time.perf_counter()
                for name, text in variants.items():
                    verdict = ev.check(text, check_shapes)
                    record["checks"][name] = asdict(verdict)
                    if not verdict.ok:
                        console.print(f"{name}: {verdict.failure}: {verdict.message}", highlight=False)
                passed = [n for n in variants if record["checks"][n]["ok"]]
                console.print(f"checked {len(variants)} variants in {time.perf_counter() - began:.0f} s: "
                              f"{len(passed)} correct", highlight=False)
            base_texts = {b: wl.program_text(b) for b in baselines}
            for shape in shapes:
                for group in batches(passed, args.batch):
                    result = ev.benchmark({**base_texts, **{n: variants[n] for n in group}}, shape)
                    record["benchmarks"].append(asdict(result))
                    best = min((t.median_us for n, t in result.programs.items() if n in group and t.median_us
                                and t.verdict.ok), default=None)
                    console.print(f"{shape}: batch of {len(group)} timed, best {best and f'{best:,.0f}'} µs",
                                  highlight=False)
            record["complete"] = True
        finally:
            record["summary"] = summary_rows(wl, args.gpus, record["benchmarks"], baselines)
            path = write_results(f"sweep-kv-transfer-{args.gpus}gpu", record,
                                 command=["python", "bench/sweep_kv.py", *sys.argv[1:]], out_dir=args.out_dir)
            if record["summary"]:
                print_table(console, record["summary"], [s.label for s in shapes], baselines, args.top)
            console.print(f"results: {path}" + ("" if record["complete"] else " (incomplete)"), highlight=False)


if __name__ == "__main__":
    main()
