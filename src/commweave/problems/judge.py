"""Judge a solution of a problem: the confined judge (`Evaluator`) on the problem's workload.

`probe` (a judge job) runs the problem's input maker and reference once per rank on two fresh
seeds in the judges' reference workers, which fixes the output layout (workload.Layout) and says
in one line why a problem cannot run here (it needs CUDA, other rank counts, or its reference
fails). `judge` then checks the solution as a candidate program on `trials` fresh seeds (poisoned
outputs, unchanged inputs, relative error within the problem's tolerance) and times it beside
the reference program in one job; the speedup is the reference's median over the solution's.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from commweave.contracts.context import ProgramContext
from commweave.contracts.result import EvalResult
from commweave.contracts.verdict import EvaluationError
from commweave.evaluate import Evaluator
from commweave.problems.format import Problem
from commweave.problems.program import solution_program
from commweave.problems.service import ReferenceError
from commweave.problems.values import HEADER, skeleton_bytes
from commweave.problems.workload import UNSTEADY, VARYING, Layout, ProblemWorkload, reference_workers, workload_for
from commweave.runtime.pool import WorkerPool

PROBE_JOB = "commweave.problems.judge:probe_rank"
ARGS_ROOM = 4096  # bytes the skeleton may grow past its probe's (a split-size list of other values)


class Unsupported(RuntimeError):
    """The problem cannot be judged here (`cause`: 'needs CUDA', 'needs other ranks', 'inputs vary
    in shape', 'reference fails'): one line why."""

    def __init__(self, cause: str, message: str):
        super().__init__(f"{cause}: {message}")
        self.cause = cause


@dataclass
class Verdict:
    """One judged solution (times in microseconds; speedup = reference median / solution median)."""

    problem: str
    world_size: int
    trials: int
    ok: bool
    failure: str | None
    speedup: float | None
    reference_us: float | None
    solution_us: float | None
    #: per program ('reference', 'solution') timed: the judge's resolution (calls per timed batch,
    #: crossing and subtracted µs, timed batches whose hold let go), for reports, not `fields()`
    resolution: dict[str, dict[str, Any]] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        """The JSON object `commweave judge --json` prints."""
        return {"ok": self.ok, "failure": self.failure, "speedup": self.speedup, "reference_us": self.reference_us,
                "solution_us": self.solution_us, "trials": self.trials, "world_size": self.world_size}


def host_bound(resolution: dict[str, dict[str, Any]]) -> list[str]:
    """The programs of a `Verdict.resolution` some of whose timed batches the GPU ran before they
    were queued (the judge's hold let go): their times show the host's pace, not the GPU's."""
    return [name for name, r in resolution.items() if r.get("hold_expired")]


def probe_rank(ctx: ProgramContext, problem: str) -> tuple[list[int], int, int, list[list[Any]], str]:
    """Judge job: this rank's result length on two fresh seeds, its skeleton's pickled bytes, the
    bytes of the input tensors whose shape differs between the two seeds (the larger draw), the
    first seed's [name, shape]s, and the skeleton's pickle in hex where both draws (and a third)
    had the same one and the same tensor shapes, else ''."""
    workers = reference_workers(Problem.from_json(problem), ctx.world_size, ctx.device.type)
    lengths, pickles, draws = [], [], []
    for seed in (secrets.randbelow(1 << 30), secrets.randbelow(1 << 30)):
        tensors, packed = workers.draws([seed], ctx.rank)[0]
        draws.append(tensors)
        pickles.append(skeleton_bytes(packed))
        lengths.append(int(workers.request("reference", seed, ctx.rank).numel()))
    varying = 0
    for name, first in draws[0].items():
        second = draws[1].get(name)
        if second is None or second.shape != first.shape:
            varying += max(t.numel() * t.element_size() for t in (first, second) if t is not None)
    same = not varying and len(draws[0]) == len(draws[1]) and pickles[0] == pickles[1]
    if same:  # a third draw: a scalar drawn from few values may repeat once
        same = skeleton_bytes(workers.draws([secrets.randbelow(1 << 30)], ctx.rank)[0][1]) == pickles[0]
    constant = pickles[0].hex() if same else ""
    return lengths, max(map(len, pickles)), varying, [[name, list(t.shape)] for name, t in draws[0].items()], constant


def _cause(message: str, device: str) -> str:
    # CUDA calls, Triton (no driver), and collectives gloo does not take as NCCL does (a stacked
    # all_gather_into_tensor output) all say the reference needs GPUs
    if device == "cpu" and re.search(r"cuda|nccl|triton|gpu|active drivers|gloo", message, re.IGNORECASE):
        return "needs CUDA"
    if re.search(r"world.?size|divisible|ranks", message, re.IGNORECASE):
        return "needs other ranks"
    return "reference fails"


def probe(pool: WorkerPool, problem: Problem) -> Layout:
    """The problem's layout at the pool's world size, or Unsupported with the reason."""
    declared = problem.unsupported(pool.world_size, pool.device)
    if declared:
        raise Unsupported("needs other ranks" if "ranks" in declared else "needs CUDA", declared)
    result = pool.run(PROBE_JOB, problem=problem.to_json())
    if not result.ok:
        cause = result.cause()
        message = cause[1].message if cause else f"no answer within {result.elapsed_s:.0f} s"
        if cause and cause[1].error_type not in (ReferenceError.__name__, "timeout"):
            raise EvaluationError(f"the judges could not probe problem {problem.name}: {cause[1].error_type}: {message}")
        raise Unsupported(_cause(message, pool.device), message.splitlines()[0] if message else "no message")
    lengths = [value[0] for value in result.values]
    fixed = all(len(set(ls)) == 1 for ls in lengths)
    out = tuple(ls[0] if fixed else 2 * max(ls) for ls in lengths)
    # room for the skeleton twice over, plus tensors that vary with the seed by value, twice over
    args = tuple(HEADER + 2 * (value[1] + value[2]) + ARGS_ROOM for value in result.values)
    inputs = tuple(tuple((name, tuple(shape)) for name, shape in value[3]) for value in result.values)
    return Layout(out, args, fixed, inputs, tuple(value[4] for value in result.values))


def judge(pool: WorkerPool, problem: Problem, solution: str, *, trials: int = 5, warmup: int = 10,
          iters: int = 30, layout: Layout | None = None) -> Verdict:
    """The verdict on `solution` (a solution file's text) for `problem` on `pool`'s ranks. Where a
    draw's arguments change though the probe saw them constant, it judges again with every call
    reading them from its inputs (workload.Layout.constant)."""
    layout = layout or probe(pool, problem)
    program = solution_program(solution, "a solution")
    try:
        try:
            result = _evaluate(pool, workload_for(problem, layout), program, trials, warmup, iters)
        except EvaluationError as exc:
            if not str(exc).startswith(UNSTEADY) or not any(layout.constant):
                raise
            layout = dataclasses.replace(layout, constant=("",) * len(layout.constant))
            result = _evaluate(pool, workload_for(problem, layout), program, trials, warmup, iters)
    except EvaluationError as exc:
        message = str(exc).splitlines()[0]
        if message.startswith(f"{VARYING}: "):  # a tensor that varies beyond the room of the skeleton
            raise Unsupported(VARYING, message.removeprefix(f"{VARYING}: ")) from exc
        raise Unsupported("reference fails", message) from exc
    reference = result.baselines.get("reference")
    reference_us = reference.median_us if reference is not None else None
    resolution = {name: t.resolution() for name, t in (("reference", reference), ("solution", result.candidate))
                  if t is not None and t.batch is not None}
    if not result.verdict.ok:
        failure = f"{result.verdict.failure.value}: {result.verdict.message}".splitlines()[0]
        return Verdict(problem.name, pool.world_size, trials, False, failure, None, reference_us,
                       result.candidate.median_us if result.candidate else None, resolution)
    return Verdict(problem.name, pool.world_size, trials, True, None, result.fitness, reference_us,
                   result.candidate.median_us, resolution)


def _evaluate(pool: WorkerPool, workload: ProblemWorkload, program: str, trials: int, warmup: int,
              iters: int) -> EvalResult:
    return Evaluator(pool, workload, seeds=trials, warmup=warmup, iters=iters).evaluate(program, workload.shape)
