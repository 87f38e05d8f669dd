"""Figure: where a problem's judge spends its time (docs/problems.md, problems-judge-phases-*.json).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        python bench/problem_phases.py <pkb>/reference/14_gemm_allgather.py --device cuda --gpus 1
    PYTHONPATH=src python bench/problem_phases.py tests/problems/allgather_matmul.py --device cpu --gpus 2

Judges PROBLEM's reference against SOLUTION (default: itself) as `commweave judge` does, and
reports the pool's start, the probe, the evaluation and, inside it, the judge's phases
(`Evaluator.phases`: start, init, setup, checks, warmup, timing; see bench/judge_throughput.py),
beside the verdict and the judge's resolution (calls per timed batch). A timed phase far longer
than calls x batches x the time of a call is the judge's own work (its draws), not the GPU's.
Writes bench/results/problems-judge-phases-<device>-<UTC>.json (or --out-dir).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from commweave.evaluate import Evaluator
from commweave.problems import judge as problem_judge
from commweave.problems.format import check_solution_file, load_problem
from commweave.report.results import RESULTS_DIR, write_results
from commweave.runtime import WorkerPool


def measure(problem: Path, solution: Path, gpus: int, device: str, **judging: int) -> dict[str, Any]:
    """One judge of `solution` on `problem` (`judging`: judge()'s trials, warmup, iters), timed by
    part (seconds)."""
    spec = load_problem(problem)
    text = check_solution_file(solution)
    evaluations: list[dict[str, Any]] = []
    evaluate = Evaluator.evaluate

    def timed_evaluate(self: Evaluator, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return evaluate(self, *args, **kwargs)
        finally:
            evaluations.append({"seconds": time.perf_counter() - began, "phases": dict(self.phases)})

    began = time.perf_counter()
    Evaluator.evaluate = timed_evaluate  # this process's judges only: the figure's own instrument
    try:
        with WorkerPool(gpus, device, job_timeout_s=600.0) as pool:
            started = time.perf_counter()
            layout = problem_judge.probe(pool, spec)
            probed = time.perf_counter()
            verdict = problem_judge.judge(pool, spec, text, layout=layout, **judging)
            judged = time.perf_counter()
    finally:
        Evaluator.evaluate = evaluate
    return {"problem": spec.name, "solution": str(solution), "world_size": gpus, "device": device, **judging,
            "pool_start_s": started - began, "probe_s": probed - started, "judge_s": judged - probed,
            "evaluations": evaluations, "verdict": verdict.fields(), "resolution": verdict.resolution}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("problem", type=Path)
    parser.add_argument("solution", type=Path, nargs="?")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    row = measure(args.problem, args.solution or args.problem, args.gpus, args.device, trials=args.trials,
                  warmup=args.warmup, iters=args.iters)
    for evaluation in row["evaluations"]:
        print(f"evaluate {evaluation['seconds']:.1f} s:", {k: round(v, 2) for k, v in evaluation["phases"].items()})
    print(f"{row['problem']}: pool start {row['pool_start_s']:.1f} s, probe {row['probe_s']:.1f} s, "
          f"judge {row['judge_s']:.1f} s; {row['verdict']}")
    path = write_results(f"problems-judge-phases-{args.device}", {"rows": [row]}, command=sys.argv,
                         out_dir=args.out_dir)
    print(path)


if __name__ == "__main__":
    main()
