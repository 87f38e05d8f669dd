"""Every problem of a folder (or a PKB checkout) through the judge, on one pool: one row each.

A problem is judged against a solution file of the same name in a solutions folder, or against its
own reference (a self-check of the judge: correct, speedup near 1). Rows carry the verdict, the
times and the cause of a failure. Each judge keeps one problem's reference workers at a time; a
problem whose programs could not start is judged again on restarted judges.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from commweave.contracts.verdict import EvaluationError, InfrastructureError
from commweave.evaluate.evaluator import HOST_OUT_OF_MEMORY
from commweave.problems.format import Problem
from commweave.problems.judge import Unsupported, judge
from commweave.runtime.candidate import NOT_STARTED
from commweave.runtime.pool import WorkerPool

SPEEDUP_BAND = (0.8, 1.25)  # a reference judged against itself should land here


@dataclass
class Row:
    """One problem's outcome. `cause`: 'ok', the failure class of a wrong solution, or why it could
    not be judged ('needs CUDA', 'needs other ranks', 'reference fails', 'infrastructure', 'host out
    of memory': a failure while the host's out-of-memory killer struck)."""

    problem: str
    solution: str
    cause: str
    ok: bool
    speedup: float | None
    reference_us: float | None
    solution_us: float | None
    message: str
    seconds: float
    resolution: dict[str, dict[str, Any]] = field(default_factory=dict)  # judge.Verdict.resolution

    @property
    def in_band(self) -> bool:
        return self.ok and self.speedup is not None and SPEEDUP_BAND[0] <= self.speedup <= SPEEDUP_BAND[1]


def solution_for(problem: Problem, solutions: Path | None) -> Path | None:
    """The solution file judged for `problem`: `<solutions>/<name>.py` (or PKB's `<name>_<backend>.py`),
    or None (no folder: the reference judges itself; a folder without one: skipped)."""
    if solutions is None:
        return Path(problem.reference)
    exact = solutions / f"{problem.name}.py"
    if exact.is_file():
        return exact
    prefixed = sorted(solutions.glob(f"{problem.name}_*.py"))
    return prefixed[0] if prefixed else None


def run_problems(problems: list[Problem], world_size: int, device: str, solutions: Path | None = None, *,
                 trials: int = 5, warmup: int = 10, iters: int = 30, job_timeout_s: float = 600.0,
                 progress: Any = None) -> list[Row]:
    """Judge every problem; `progress(row)` is called after each."""
    rows: list[Row] = []
    with WorkerPool(world_size, device, job_timeout_s=job_timeout_s) as pool:
        for problem in problems:
            began = time.monotonic()
            path = solution_for(problem, solutions)
            if path is None:
                continue
            row = _judged(pool, problem, path, trials, warmup, iters)
            if NOT_STARTED in row.message:  # e.g. NCCL's init after many problems: fresh judges, once more
                pool.restart()
                row = _judged(pool, problem, path, trials, warmup, iters)
            row.seconds = time.monotonic() - began
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows


def _judged(pool: WorkerPool, problem: Problem, path: Path, trials: int, warmup: int, iters: int) -> Row:
    try:
        verdict = judge(pool, problem, path.read_text(), trials=trials, warmup=warmup, iters=iters)
        cause = cause_of(verdict.failure)
        return Row(problem.name, str(path), cause, verdict.ok, verdict.speedup, verdict.reference_us,
                   verdict.solution_us, verdict.failure or "", 0.0, verdict.resolution)
    except Unsupported as exc:
        return Row(problem.name, str(path), exc.cause, False, None, None, None, str(exc), 0.0)
    except (EvaluationError, InfrastructureError) as exc:
        pool.restart()
        return Row(problem.name, str(path), "infrastructure", False, None, None, None, str(exc).splitlines()[0], 0.0)


def cause_of(failure: str | None) -> str:
    """A row's cause from a verdict's failure line ('<class>: <message>', None when correct)."""
    if failure is None:
        return "ok"
    if HOST_OUT_OF_MEMORY in failure:
        return "host out of memory"
    return failure.split(":")[0]


def summary(rows: list[Row]) -> dict[str, Any]:
    """Counts: judged, correct, correct with speedup in SPEEDUP_BAND, and failures by cause."""
    causes: dict[str, int] = {}
    for row in rows:
        if not row.ok:
            causes[row.cause] = causes.get(row.cause, 0) + 1
    return {"problems": len(rows), "ok": sum(r.ok for r in rows), "ok_in_band": sum(r.in_band for r in rows),
            "band": list(SPEEDUP_BAND), "failed_by_cause": causes}


def rows_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [{**asdict(r), "in_band": r.in_band} for r in rows]
