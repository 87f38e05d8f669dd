"""Figure: bench/results/judge-fidelity-{1gpu,cpu}-*.json, the judge's time of a program against its in-process time.

Judge fidelity: the judge's time of a program against the same work timed in-process, per shape.

    PYTHONPATH=src python bench/judge_fidelity.py --device cpu
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        python bench/judge_fidelity.py --device cuda

W = 1. On one GPU: gemm-reducescatter's host program (one cuBLAS bf16 GEMM; the reduce-scatter of
one rank is a copy) at 1024^3, 2048^3, 4096^3, 8192^3. On CPU: the toy gather-matmul's host
program (tests/toy_workload.py, float32) at 64^3 and 384^3. Per shape:

- `inprocess_us`: the program's setup/run called in this process, batches of K calls on K
  rotating input sets between two CUDA events behind the context's hold (CPU: the wall clock), the
  median per-call time over `--batches` batches (K sized as the judge sizes it) after `WARM_S` of
  untimed batches;
- `judge_us`: the median the judge reports for the same program (`Evaluator.benchmark`), with
  the judge's resolution (`batch`: calls per timed batch; `crossing_us`: what a batch costs
  beyond its calls; `subtracted_us`: what the judge took off every batch; `hold_expired`: timed
  batches that started before they were queued);
- `twice_fitness`: host time over the time of a program calling the host's run twice (0.5 when
  the second run costs the GPU what the first does), and `twice_inprocess_fitness`, the same ratio
  timed in process (what the GPU sees: the second run finds its inputs in L2 at small shapes);
  `honest_fitness`: host time over an identical copy's (true 1.0), all three timed in one job;
- `capacity`: the most calls a batch had room for (memory), beside `batch`, the calls it held.

Writes bench/results/judge-fidelity-1gpu-<stamp>.json (or -cpu-) with provenance.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from commweave.contracts.program import load_program  # noqa: E402
from commweave.contracts.workload import Shape, Workload  # noqa: E402
from commweave.evaluate import Evaluator  # noqa: E402
from commweave.evaluate.timing import BATCH_BYTES, batch_capacity, batch_size  # noqa: E402
from commweave.report.results import write_results  # noqa: E402
from commweave.runtime import WorkerPool, apply_safe_env  # noqa: E402
from commweave.runtime.pool import _build_context  # noqa: E402

GPU_SIZES = (1024, 2048, 4096, 8192)
#: seconds of batches run in process before the timed ones: an H100 read 8192^3 at 1627 µs after
#: three warm-up batches and 1477 µs in the judge's job right after (clocks still settling)
WARM_S = 2.0
CPU_SIZES = (64, 384)
END = "# EVOLVE-BLOCK-END"


def twice(text: str) -> str:
    """The same program, its run() called twice per call: twice the work, the same result."""
    if text.count("def run(ctx, state, inputs, out):") != 1 or END not in text:
        raise ValueError("the host program must define run(ctx, state, inputs, out) once, inside its evolve block")
    body = text.replace("def run(ctx, state, inputs, out):", "def _run_once(ctx, state, inputs, out):")
    wrapper = ("def run(ctx, state, inputs, out):\n    _run_once(ctx, state, inputs, out)\n"
               "    _run_once(ctx, state, inputs, out)\n")
    return body.replace(END, wrapper + END)


def workload_and_shapes(device: str) -> tuple[Workload, list[Shape], str]:
    if device == "cuda":
        from commweave.workloads import get_workload

        wl = get_workload("gemm-reducescatter")
        return wl, [wl.make_shape(s, s, s, 1) for s in GPU_SIZES], wl.program_text("host")
    from toy_workload import ToyGatherMatmul

    wl = ToyGatherMatmul()
    return wl, [wl.make_shape(s, s, s) for s in CPU_SIZES], wl.program_text("host")


def in_process_us(ctx: Any, wl: Workload, text: str, shape: Shape, batches: int) -> tuple[float, int]:
    """Median per-call µs of the program run in this process, and the calls per batch."""
    device = ctx.device.type
    program = load_program(text, "host")
    state = program.setup(ctx, shape)
    probe = wl.make_inputs(shape, 1, 0, 0, ctx.device)
    out_like = wl.make_output(shape, 1, 0, ctx.device)
    call_bytes = sum(t.numel() * t.element_size() for t in probe.values()) + out_like.numel() * out_like.element_size()
    capacity = batch_capacity(call_bytes, BATCH_BYTES[device], device)
    flush = torch.empty(100 << 20, dtype=torch.uint8, device=ctx.device) if ctx.is_cuda else None

    def timed(sets: list[dict[str, torch.Tensor]], outs: list[torch.Tensor]) -> float:
        if not ctx.is_cuda:
            began = time.perf_counter()
            for inputs, out in zip(sets, outs):
                program.run(ctx, state, dict(inputs), out)
            return (time.perf_counter() - began) / len(sets)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        release = ctx.hold_stream(timeout_s=0.25)
        flush.zero_()
        start.record()
        for inputs, out in zip(sets, outs):
            program.run(ctx, state, dict(inputs), out)
        end.record()
        release()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3 / len(sets)

    one = [timed([probe], [out_like]) for _ in range(3)]
    k = batch_size(min(one), capacity, device)
    sets = [wl.make_inputs(shape, 1, 0, seed, ctx.device) for seed in range(1, k + 1)]
    outs = [torch.empty_like(out_like) for _ in range(k)]
    for _ in range(3):
        timed(sets, outs)
    k = batch_size(timed(sets, outs), capacity, device)
    while len(sets) < k:
        sets.append(wl.make_inputs(shape, 1, 0, len(sets) + 1, ctx.device))
        outs.append(torch.empty_like(out_like))
    sets, outs = sets[:k], outs[:k]
    began = time.perf_counter()
    while time.perf_counter() - began < WARM_S:  # the GPU's clocks settle under load (as in the judge's long job)
        timed(sets, outs)
    per_call = [timed(sets, outs) for _ in range(batches)]
    return statistics.median(per_call) * 1e6, k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--batches", type=int, default=20, help="timed batches, in process and per program in the judge")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    apply_safe_env()
    wl, shapes, host = workload_and_shapes(args.device)
    doubled = twice(host)
    with tempfile.TemporaryDirectory() as folder:
        ctx = _build_context(0, 1, args.device, str(Path(folder) / "store"))
        inprocess, inprocess_twice = {}, {}
        for shape in shapes:
            inprocess[shape.label] = in_process_us(ctx, wl, host, shape, args.batches)
            inprocess_twice[shape.label] = in_process_us(ctx, wl, doubled, shape, args.batches)[0]
            if ctx.is_cuda:
                torch.cuda.empty_cache()  # this process stays idle (and small) while the judge times
        torch.distributed.destroy_process_group()  # (left up, it held the process at exit on one H200)
    paths = [str(ROOT / "tests"), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    env = {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    rows = []
    with WorkerPool(1, device=args.device, job_timeout_s=600, env=env) as pool:
        evaluator = Evaluator(pool, wl, warmup=args.warmup, iters=args.batches)
        for shape in shapes:
            bench = evaluator.benchmark({"host": host, "honest": host, "twice": doubled}, shape)
            timings = bench.programs
            failed = [f"{n}: {t.verdict.failure}: {t.verdict.message}" for n, t in timings.items() if t.median_us is None]
            if failed:
                raise SystemExit(f"{shape.label}: " + "; ".join(failed))
            host_us = timings["host"].median_us
            inproc_us, inproc_k = inprocess[shape.label]
            rows.append({
                "shape": shape.label, "inprocess_us": inproc_us, "inprocess_batch": inproc_k, "judge_us": host_us,
                "ratio": host_us / inproc_us, "twice_fitness": host_us / timings["twice"].median_us,
                "inprocess_twice_us": inprocess_twice[shape.label],
                "twice_inprocess_fitness": inproc_us / inprocess_twice[shape.label], "capacity": bench.input_sets,
                "honest_fitness": host_us / timings["honest"].median_us,
                "batch": {n: t.batch for n, t in timings.items()},
                "crossing_us": {n: t.crossing_us for n, t in timings.items()},
                "subtracted_us": timings["host"].subtracted_us,
                "hold_expired": {n: t.hold_expired for n, t in timings.items()},
                "verdicts": {n: t.verdict.ok for n, t in timings.items()},
            })
            print(f"{shape.label}: in-process {inproc_us:.1f} µs, judge {host_us:.1f} µs (x{host_us / inproc_us:.3f}), "
                  f"twice {rows[-1]['twice_fitness']:.3f} (in process {rows[-1]['twice_inprocess_fitness']:.3f}), honest {rows[-1]['honest_fitness']:.3f}, "
                  f"K {timings['host'].batch}, crossing {timings['host'].crossing_us:.0f} µs", flush=True)
    tag = "1gpu" if args.device == "cuda" else "cpu"
    payload = {"device": args.device, "world": 1, "workload": wl.name, "batches": args.batches, "warmup": args.warmup,
               "rows": rows}
    path = write_results(f"judge-fidelity-{tag}", payload, command=["python", "bench/judge_fidelity.py", *sys.argv[1:]],
                         out_dir=args.out_dir)
    print(f"{'shape':>16} {'in-proc µs':>11} {'judge µs':>10} {'ratio':>7} {'twice':>7} {'(in-proc)':>9} "
          f"{'honest':>7} {'K':>5} {'room':>5} {'cross µs':>9}")
    for r in rows:
        print(f"{r['shape']:>16} {r['inprocess_us']:11.1f} {r['judge_us']:10.1f} {r['ratio']:7.3f} "
              f"{r['twice_fitness']:7.3f} {r['twice_inprocess_fitness']:9.3f} {r['honest_fitness']:7.3f} "
              f"{r['batch']['host']:5d} {r['capacity']:5d} {r['crossing_us']['host']:9.0f}")
    print(path)


if __name__ == "__main__":
    main()
