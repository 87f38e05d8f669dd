"""Figure: bench/results/judge-fidelity-{1gpu,cpu}-*.json, the judge's time of a program against its in-process time.

Judge fidelity: the judge's time of a program against the same work timed in-process, per shape.

    PYTHONPATH=src python bench/judge_fidelity.py --device cpu
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        python bench/judge_fidelity.py --device cuda

W = 1. On one GPU: gemm-reducescatter's host program (one cuBLAS bf16 GEMM; the reduce-scatter of
one rank is a copy) at 1024^3, 2048^3, 4096^3, 8192^3. On CPU: the toy gather-matmul's host
program (tests/toy_workload.py, float32) at 64^3 and 384^3. Per shape:

- `inprocess_us`: the program's setup/run called in this process at the judge's pace: the three
  programs below, each with the K the judge gave it, in the judge's rotation, each batch between
  two CUDA events behind the context's hold (CPU: the wall clock) and given the judge's wall time
  per timed batch (`period_ms`, the rest idle), median per-call time over `--batches` rotations
  after `WARM_S` of them. An H100 under its 700 W cap clocked 1400-1600 MHz through back-to-back
  8192^3 GEMMs and ~1950 MHz in the judge's job (its draws, checks and requests leave gaps): at
  equal duty both see the same clocks. `back_to_back_us` (and `ratio_back_to_back`) is the same
  program timed in batches back to back, K sized as the judge sizes it;
- `judge_us`: the median the judge reports for the same program (`Evaluator.benchmark`), with
  the judge's resolution (`batch`: calls per timed batch; `crossing_us`: what a batch costs
  beyond its calls; `subtracted_us`: what the judge took off every batch; `hold_expired`: timed
  batches that started before they were queued);
- `twice_fitness`: host time over the time of a program calling the host's run twice (0.5 when
  the second run costs the GPU what the first does), and `twice_inprocess_fitness`, the same ratio
  timed in process at the judge's pace (what the GPU sees: the second run finds its inputs in L2
  at small shapes);
  `honest_fitness`: host time over an identical copy's (true 1.0), all three timed in one job;
- `capacity`: the most calls a batch had room for (memory), beside `batch`, the calls it held.

Writes bench/results/judge-fidelity-1gpu-<stamp>.json (or -cpu-) with provenance.
"""

from __future__ import annotations

import argparse
import multiprocessing
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


def workload_and_shapes(device: str, sizes: list[int] | None) -> tuple[Workload, list[Shape], str]:
    if device == "cuda":
        from commweave.workloads import get_workload

        wl = get_workload("gemm-reducescatter")
        return wl, [wl.make_shape(s, s, s, 1) for s in sizes or GPU_SIZES], wl.program_text("host")
    from toy_workload import ToyGatherMatmul

    wl = ToyGatherMatmul()
    return wl, [wl.make_shape(s, s, s) for s in sizes or CPU_SIZES], wl.program_text("host")


class InProcess:
    """One program run in this process on its own K input sets and outputs, timed per batch the
    way the judge times it (CUDA events behind the context's hold, L2 flushed; CPU: the wall clock)."""

    def __init__(self, ctx: Any, wl: Workload, text: str, name: str, shape: Shape):
        self.ctx, self.wl, self.shape = ctx, wl, shape
        self.program = load_program(text, name)
        self.state = self.program.setup(ctx, shape)
        self.sets = [wl.make_inputs(shape, 1, 0, 0, ctx.device)]
        self.out_like = wl.make_output(shape, 1, 0, ctx.device)
        self.outs = [self.out_like]
        self.flush = torch.empty(100 << 20, dtype=torch.uint8, device=ctx.device) if ctx.is_cuda else None

    def call_bytes(self) -> int:
        return (sum(t.numel() * t.element_size() for t in self.sets[0].values())
                + self.out_like.numel() * self.out_like.element_size())

    def resize(self, k: int) -> None:
        while len(self.sets) < k:
            self.sets.append(self.wl.make_inputs(self.shape, 1, 0, len(self.sets) + 1, self.ctx.device))
            self.outs.append(torch.empty_like(self.out_like))
        self.sets, self.outs = self.sets[:k], self.outs[:k]

    def timed(self) -> float:
        """Seconds per call of one batch over every input set."""
        ctx, program, state = self.ctx, self.program, self.state
        if not ctx.is_cuda:
            began = time.perf_counter()
            for inputs, out in zip(self.sets, self.outs):
                program.run(ctx, state, dict(inputs), out)
            return (time.perf_counter() - began) / len(self.sets)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        release = ctx.hold_stream(timeout_s=0.25)
        self.flush.zero_()
        start.record()
        for inputs, out in zip(self.sets, self.outs):
            program.run(ctx, state, dict(inputs), out)
        end.record()
        release()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3 / len(self.sets)


def back_to_back_us(ctx: Any, wl: Workload, text: str, shape: Shape, batches: int) -> tuple[float, int]:
    """Median per-call µs of batches run back to back in this process (K sized as the judge sizes
    it), after `WARM_S` of them, and K."""
    device = ctx.device.type
    run = InProcess(ctx, wl, text, "host", shape)
    capacity = batch_capacity(run.call_bytes(), BATCH_BYTES[device], device)
    one = [run.timed() for _ in range(3)]
    run.resize(batch_size(min(one), capacity, device))
    for _ in range(3):
        run.timed()
    run.resize(batch_size(run.timed(), capacity, device))
    began = time.perf_counter()
    while time.perf_counter() - began < WARM_S:  # the GPU's clocks settle under load (as in the judge's long job)
        run.timed()
    per_call = [run.timed() for _ in range(batches)]
    return statistics.median(per_call) * 1e6, len(run.sets)


def paced_us(ctx: Any, wl: Workload, programs: dict[str, str], shape: Shape, sizes: dict[str, int],
             period_s: float, batches: int) -> dict[str, float]:
    """Median per-call µs of each program timed in this process the way the judge ran them: the
    same K each, batches in the judge's rotation, each batch given the judge's wall time per batch
    (`period_s`, the rest idle). A GPU under its power cap clocks down under back-to-back GEMMs
    and recovers in the judge's gaps (draws, checks, requests): at equal duty the two see the
    same clocks."""
    runs = {name: InProcess(ctx, wl, text, name, shape) for name, text in programs.items()}
    for name, run in runs.items():
        run.resize(sizes[name])
    times: dict[str, list[float]] = {name: [] for name in runs}

    def rotation(record: bool) -> None:
        for name, run in runs.items():
            began = time.perf_counter()
            seconds = run.timed()
            if record:
                times[name].append(seconds)
            time.sleep(max(0.0, period_s - (time.perf_counter() - began)))

    began = time.perf_counter()
    while time.perf_counter() - began < WARM_S:
        rotation(False)
    for _ in range(batches):
        rotation(True)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def in_process(device: str, size: int, programs: dict[str, str], sizes: dict[str, int], period_s: float,
               batches: int) -> tuple[dict[str, float], float, int, float]:
    """In a child process: `paced_us` of the programs, then `back_to_back_us` of the host and of
    the twice-work program."""
    apply_safe_env()
    wl, [shape], host = workload_and_shapes(device, [size])
    with tempfile.TemporaryDirectory() as folder:
        ctx = _build_context(0, 1, device, str(Path(folder) / "store"))
        paced = paced_us(ctx, wl, programs, shape, sizes, period_s, batches)
        b2b_us, b2b_k = back_to_back_us(ctx, wl, host, shape, batches)
        b2b_twice_us = back_to_back_us(ctx, wl, programs["twice"], shape, batches)[0]
        torch.distributed.destroy_process_group()  # (left up, it held the process at exit on one H200)
    return paced, b2b_us, b2b_k, b2b_twice_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--batches", type=int, default=20, help="timed batches, in process and per program in the judge")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", help="square GEMM sizes (default: 1024-8192 on GPUs, 64 384 on CPU)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    apply_safe_env()
    wl, shapes, host = workload_and_shapes(args.device, args.sizes)
    doubled = twice(host)
    paths = [str(ROOT / "tests"), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    env = {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    programs = {"host": host, "honest": host, "twice": doubled}
    rows = []
    spawn = multiprocessing.get_context("spawn")
    with WorkerPool(1, device=args.device, job_timeout_s=600, env=env) as pool:
        evaluator = Evaluator(pool, wl, warmup=args.warmup, iters=args.batches)
        for size, shape in zip(args.sizes or (GPU_SIZES if args.device == "cuda" else CPU_SIZES), shapes):
            evaluator.phases = {}
            bench = evaluator.benchmark(programs, shape)  # first, with no other process holding the device's memory
            timings = bench.programs
            failed = [f"{n}: {t.verdict.failure}: {t.verdict.message}" for n, t in timings.items() if t.median_us is None]
            if failed:
                raise SystemExit(f"{shape.label}: " + "; ".join(failed))
            # the judge's wall time per timed batch: timed batches and the checks of their outputs
            period_s = (evaluator.phases["timing"] + evaluator.phases.get("checks", 0.0)) / (len(programs) * args.batches)
            sizes = {n: t.batch for n, t in timings.items()}
            with spawn.Pool(1) as child:  # its own process: everything it allocated goes back when it exits
                paced, b2b_us, b2b_k, b2b_twice_us = child.apply(
                    in_process, (args.device, size, programs, sizes, period_s, args.batches))
            host_us = timings["host"].median_us
            rows.append({
                "shape": shape.label, "inprocess_us": paced["host"], "judge_us": host_us,
                "ratio": host_us / paced["host"], "twice_fitness": host_us / timings["twice"].median_us,
                "honest_fitness": host_us / timings["honest"].median_us,
                "twice_inprocess_fitness": paced["host"] / paced["twice"],
                "honest_inprocess_fitness": paced["host"] / paced["honest"],
                "period_ms": period_s * 1e3,
                "back_to_back_us": b2b_us, "back_to_back_batch": b2b_k, "ratio_back_to_back": host_us / b2b_us,
                "twice_back_to_back_fitness": b2b_us / b2b_twice_us, "capacity": bench.input_sets,
                "batch": {n: t.batch for n, t in timings.items()},
                "crossing_us": {n: t.crossing_us for n, t in timings.items()},
                "subtracted_us": timings["host"].subtracted_us,
                "hold_expired": {n: t.hold_expired for n, t in timings.items()},
                "verdicts": {n: t.verdict.ok for n, t in timings.items()},
            })
            r = rows[-1]
            print(f"{shape.label}: judge {host_us:.1f} µs; in process at the judge's pace {paced['host']:.1f} µs "
                  f"(x{r['ratio']:.3f}), back to back {b2b_us:.1f} µs (x{r['ratio_back_to_back']:.3f}); twice "
                  f"{r['twice_fitness']:.3f} (in process {r['twice_inprocess_fitness']:.3f}), honest "
                  f"{r['honest_fitness']:.3f}, K {timings['host'].batch}, crossing {timings['host'].crossing_us:.0f} µs, "
                  f"period {period_s * 1e3:.1f} ms", flush=True)
    tag = "1gpu" if args.device == "cuda" else "cpu"
    payload = {"device": args.device, "world": 1, "workload": wl.name, "batches": args.batches, "warmup": args.warmup,
               "rows": rows}
    path = write_results(f"judge-fidelity-{tag}", payload, command=["python", "bench/judge_fidelity.py", *sys.argv[1:]],
                         out_dir=args.out_dir)
    print(f"{'shape':>16} {'in-proc µs':>11} {'judge µs':>10} {'ratio':>7} {'b2b':>7} {'twice':>7} {'(in-proc)':>9} "
          f"{'honest':>7} {'K':>5} {'room':>5} {'cross µs':>9}")
    for r in rows:
        print(f"{r['shape']:>16} {r['inprocess_us']:11.1f} {r['judge_us']:10.1f} {r['ratio']:7.3f} "
              f"{r['ratio_back_to_back']:7.3f} {r['twice_fitness']:7.3f} {r['twice_inprocess_fitness']:9.3f} "
              f"{r['honest_fitness']:7.3f} {r['batch']['host']:5d} {r['capacity']:5d} {r['crossing_us']['host']:9.0f}")
    print(path)


if __name__ == "__main__":
    main()
