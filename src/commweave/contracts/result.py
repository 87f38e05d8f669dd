"""What an evaluation returns: typed, so the search, the fast path and reports read fields, not guesses.

`ProgramTiming` is one program's benchmark on one shape; `BenchResult` all programs timed side by
side in one job; `EvalResult` a candidate's full evaluation (fitness, verdict, its timing and its
baselines'). `Judge` is what the search needs of an evaluator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from commweave.contracts.verdict import Verdict
from commweave.contracts.workload import Shape


@dataclass
class ProgramTiming:
    """One program's benchmark on one shape (times in microseconds, None when it was not timed)."""

    name: str
    verdict: Verdict
    median_us: float | None = None
    min_us: float | None = None
    p90_us: float | None = None
    per_iter_us: list[float] = field(default_factory=list)  # each iteration's maximum over ranks
    #: GPUs only: device memory the program holds after setup plus what a call adds at its peak,
    #: the largest over ranks (inputs and the output, which the harness owns, not counted)
    memory_bytes: int | None = None
    #: the judge's resolution: calls per timed batch, and what a batch costs beyond its calls
    #: (request, answer, events; the largest over ranks), in microseconds
    batch: int | None = None
    crossing_us: float | None = None
    #: what the judge took off each of this benchmark's batches: the smallest program's crossing
    subtracted_us: float | None = None
    #: GPUs: timed batches whose hold let go before the program had queued them (its CPU showed)
    hold_expired: int | None = None

    def resolution(self) -> dict[str, Any] | None:
        """The judge's resolution as plain JSON, or None where the program was not timed in batches."""
        if self.batch is None:
            return None
        return {"batch": self.batch, "crossing_us": self.crossing_us, "subtracted_us": self.subtracted_us,
                "hold_expired": self.hold_expired}


@dataclass
class BenchResult:
    shape: str
    floor_us: float
    warmup: int
    iters: int
    input_sets: int  # how many rotating input sets the job used (0 if it never got that far)
    programs: dict[str, ProgramTiming]


@dataclass
class EvalResult:
    """A candidate's full evaluation on one shape (times in microseconds)."""

    fitness: float  # baseline median / candidate median; 0 on every failure path
    verdict: Verdict  # the candidate's: its first failure, or passed
    shape: str
    candidate: ProgramTiming | None = None
    baseline: str | None = None  # the baseline the fitness is relative to
    baselines: dict[str, ProgramTiming] = field(default_factory=dict)  # every baseline: timed, failed or unavailable
    floor_us: float | None = None


class Judge(Protocol):
    """An evaluator as the search and the fast path use it: a program text on a shape in, a result out."""

    def evaluate(self, text: str, shape: Shape) -> EvalResult: ...

    def compile_source(self, source: str) -> object: ...
