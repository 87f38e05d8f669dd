"""Figure: kv-transfer's push-kernel sweep (kv_transfer/NOTES.md, sweep-kv-transfer-*.json): CTAs x threads x unroll.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src:tests \\
        python bench/sweep_kv.py --gpus 2

Default grid: ctas 32,64,96,132 x threads 256,512,1024 x unroll 2,4,8 (36 variants) on S2048 and
S16384; any CONFIG knob can be swept instead (`--grid prefill_ctas=8,16,32 --shapes S2048-P13`)
or fixed (`--set graph=false`). Every variant's CUDA is compiled first (in parallel, into the
cache the workers read); then `commweave.evaluate.bench.bench_workload` (the path of `commweave
bench`) checks every program for correctness on the check shapes plus a transfer-only shape with
more pages than CTAs, and times the survivors per shape in batches, each batch beside the host
baselines (`host`, `host_layerwise`; `host_per_block` takes a second a call at S16384). Every
benchmark also judges each program's last output bit-exactly. The table at the end lists each
variant's median µs and GB/s per shape, best first. Results go to bench/results/ (or --out-dir),
also when the run is cut short by SIGTERM (then `complete` is false).
"""

from __future__ import annotations

import argparse
import itertools
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import parse_grid  # noqa: E402  (bench/ is not a package)

from commweave.contracts.program import load_program, with_config  # noqa: E402
from commweave.evaluate.bench import BenchReport, BenchStep, bench_workload  # noqa: E402
from commweave.report.bench import ranking_table  # noqa: E402
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
    unknown = sorted(set(baselines) - set(wl.baselines))
    if unknown:
        raise SystemExit(f"unknown baseline {', '.join(unknown)} (baselines: {', '.join(wl.baselines)})")
    variants = variants_of(wl.program_text(wl.seed), grid, fixed)  # with_config refuses unknown knobs
    console = Console()
    console.print(f"{len(variants)} variants x {len(shapes)} shapes on {args.gpus} GPUs, batches of {args.batch}",
                  highlight=False)
    precompile(variants, console)
    check_shapes = [] if args.no_check else [*wl.check_shapes(args.gpus), wl.parse_shape(EXTRA_CHECK_SHAPE, args.gpus)]
    so_far: list[BenchReport] = []

    def show(step: BenchStep) -> None:
        so_far[:] = [step.report] if step.report is not None else []
        console.print(f"[{step.done}/{step.total}] {step.description}", highlight=False, markup=False)

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    with WorkerPool(args.gpus, job_timeout_s=300) as pool:
        try:
            bench_workload(pool, wl, shapes, {b: wl.program_text(b) for b in baselines} | variants, iters=args.iters,
                           warmup=args.warmup, job_timeout_s=300, check_shapes=check_shapes, check_each_shape=False,
                           batch=args.batch, command=["python", "bench/sweep_kv.py", *sys.argv[1:]],
                           meta={"grid": grid, "fixed": fixed}, progress=show)
        finally:
            if so_far:
                report = so_far[0]
                path = write_results(f"sweep-kv-transfer-{args.gpus}gpu", report.to_json(), out_dir=args.out_dir,
                                     provenance=report.provenance)
                table, hidden = ranking_table(report, "kv-transfer seed sweep: median µs (GB/s, x best baseline)",
                                              top=args.top, bandwidth=True, versus="best")
                console.print(table)
                if hidden:
                    console.print(f"({hidden} slower variants in the results file)")
                console.print(f"results: {path}" + ("" if report.complete else " (incomplete)"), highlight=False)


if __name__ == "__main__":
    main()
