"""Figure: the judge's throughput (docs/evaluation.md, judge-throughput-*.json): candidates per minute through the cascade, and where the time goes.

    PYTHONPATH=src python bench/judge_throughput.py --device cpu --world 2 --candidates 6
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        python bench/judge_throughput.py --device cuda --world 1 --candidates 12

Runs the toy gather-matmul workload (tests/toy_workload.py; W = 1 is its one-GPU case) with its
host program as the candidate: each candidate goes through `Evaluator.evaluate` (compile, checks on
the check shapes and the bench shape, benchmark beside the baseline). Reports candidates/min after
the pool started (pool start separately), the evaluator-side split (check job vs benchmark job)
and, where the evaluator reports them (`Evaluator.phases`), the judge-side phases: `start` (fork of
the program processes until they are confined and their process group is up), `init` (of that,
the process group and rank context: gloo, or CUDA + NCCL), `setup` (load, setup(), sharing the
buffers), `checks` (runs judged and the verification of timed outputs, with the judge drawing
fresh values), `warmup` (probe and warm-up batches), `timing` (timed batches), and the judge's resolution per
candidate (calls per timed batch, a batch's crossing cost). Writes bench/results/judge-throughput-<device>-<W>-<UTC>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from commweave.evaluate import Evaluator  # noqa: E402
from commweave.report.results import write_results  # noqa: E402
from commweave.runtime import WorkerPool, apply_safe_env  # noqa: E402
from toy_workload import ToyGatherMatmul  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--candidates", type=int, default=6)
    parser.add_argument("--shape", default="64x64x64", help="the benchmark shape, MxKxN")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--label", default="", help="a tag for the results file name, e.g. 'before'")
    parser.add_argument("--unconfined", action="store_true", help="program processes without the optional confinement "
                        "(namespaces, Landlock, dropped privileges): what the sealing costs, measured beside a default run")
    args = parser.parse_args()
    if args.candidates < 1:
        parser.error("--candidates must be >= 1")
    apply_safe_env()
    workload = ToyGatherMatmul()
    shape = workload.parse_shape(args.shape, args.world)
    text = (ROOT / "tests" / "programs_cpu" / "host.py").read_text()
    paths = [str(ROOT / "tests"), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    env = {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    began = time.perf_counter()
    with WorkerPool(args.world, device=args.device, job_timeout_s=300, env=env) as pool:
        pool_start_s = time.perf_counter() - began
        if args.unconfined:
            dropped = pool.run("runtime_jobs:drop_confinement")
            if not dropped.ok:
                raise SystemExit(f"could not drop the confinement: {dropped.first_failure()}")
        evaluator = Evaluator(pool, workload, warmup=args.warmup, iters=args.iters)
        evaluator.evaluate(text, shape)  # the first: baseline checks (cached after), compile cache, imports
        per_candidate, fitness, phases, resolution = [], [], [], []
        split = {"check_s": [], "bench_s": []}
        for _ in range(args.candidates):
            t0 = time.perf_counter()
            result = evaluator.evaluate(text, shape)
            per_candidate.append(time.perf_counter() - t0)
            if not result.verdict.ok:
                raise SystemExit(f"the honest candidate failed: {result.verdict.failure}: {result.verdict.message}")
            fitness.append(result.fitness)
            resolution.append({"batch": result.candidate.batch, "crossing_us": result.candidate.crossing_us})
            phases.append(dict(getattr(evaluator, "phases", {})))
        for _ in range(min(3, args.candidates)):  # the two jobs of one evaluation, timed apart
            t0 = time.perf_counter()
            evaluator.check(text, [*workload.check_shapes(args.world), shape])
            t1 = time.perf_counter()
            evaluator.benchmark({"candidate": text, "host": text}, shape)
            split["check_s"].append(t1 - t0)
            split["bench_s"].append(time.perf_counter() - t1)
    mean_s = statistics.mean(per_candidate)
    phase_means = {k: statistics.mean(p.get(k, 0.0) for p in phases) for k in sorted({k for p in phases for k in p})}
    payload = {
        "device": args.device, "world": args.world, "shape": shape.label, "warmup": args.warmup, "iters": args.iters,
        "candidates": args.candidates, "confined": not args.unconfined, "pool_start_s": pool_start_s, "seconds_per_candidate": per_candidate,
        "candidates_per_min": 60.0 / mean_s, "fitness_of_honest_copy": fitness,
        "evaluator_split_s": {k: statistics.mean(v) for k, v in split.items()}, "judge_phases_s": phase_means,
        "resolution": resolution,  # the candidate's calls per timed batch and a batch's crossing cost
    }
    label = f"-{args.label}" if args.label else ""
    path = write_results(f"judge-throughput{label}-{args.device}-{args.world}", payload,
                         command=["python", "bench/judge_throughput.py", *sys.argv[1:]], out_dir=ROOT / "bench" / "results")
    print(f"pool start {pool_start_s:.1f} s; {60.0 / mean_s:.1f} candidates/min ({mean_s:.2f} s each); "
          f"fitness of an honest copy: median {statistics.median(fitness):.3f}")
    print("evaluator split:", {k: round(v, 3) for k, v in payload["evaluator_split_s"].items()})
    if phase_means:
        print("judge phases (s per candidate, max over ranks):", {k: round(v, 3) for k, v in phase_means.items()})
    print(path)


if __name__ == "__main__":
    main()
