"""Verdicts: whether a program passed a stage, and if not, which failure class and why.

A verdict is built on each rank (or in the calling process for compile errors) and the calling
process merges the ranks' verdicts: the first failing rank wins. Every failure carries a class, a
message naming rank, shape and seed where known, and the search scores it 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class FailureClass(str, Enum):
    """Why a program got fitness 0. A str enum, so `asdict` + `json.dumps` write the bare name."""

    COMPILE_ERROR = "compile_error"  # malformed program text or nvcc rejected its CUDA source
    RUNTIME_ERROR = "runtime_error"  # an exception, or a worker that died
    ILLEGAL_ADDRESS = "illegal_address"  # a sticky CUDA error: the worker's context is gone
    TIMEOUT = "timeout"  # no answer in time (deadlock): the pool was restarted
    WRONG_RESULT = "wrong_result"  # error above tolerance, unwritten output, mutated input
    NAN = "nan"  # NaN or Inf in the output
    SUSPECT = "suspect"  # faster than physics allows, or work escaped the timed region
    UNAVAILABLE = "unavailable"  # the program says it cannot run here (not a failure of a candidate)
    #: it reached outside its own process: killed or broke a judge process or its own parent, left
    #: processes behind that escaped its process group, made a baseline fail beside it
    TAMPERING = "tampering"

    def __str__(self) -> str:
        return self.value


class EvaluationError(RuntimeError):
    """The harness itself is broken (workload not importable in workers, no usable baseline): no
    candidate can be judged, so the caller must hear about it."""


class InfrastructureError(EvaluationError):
    """The machine, not a candidate, failed: the pool or a program process could not start, or a
    judge process died and a fresh pool could not judge a baseline either."""


class WorkloadError(RuntimeError):
    """Raised in a worker that cannot build the workload; the parent raises EvaluationError."""


class HarnessError(RuntimeError):
    """Raised in a judge process when harness code (inputs, reference, checks) failed while judging
    a program. It scores as that program's runtime_error; a broken workload shows as every
    program, its baselines included, failing with this message."""


@dataclass
class Verdict:
    ok: bool
    failure: FailureClass | None = None
    message: str = ""
    rank: int | None = None
    shape: str | None = None
    seed: int | None = None
    detail: str = ""  # a traceback, for whoever repairs the program

    @classmethod
    def passed(cls, message: str = "") -> Verdict:
        return cls(True, None, message)

    @classmethod
    def failed(cls, failure: FailureClass, what: str, *, rank: int | None = None, shape: str | None = None,
               seed: int | None = None, detail: str = "") -> Verdict:
        """A failure whose message says where it happened (rank, shape, seed), as far as known."""
        where = [f"{k} {v}" for k, v in (("rank", rank), ("shape", shape), ("seed", seed)) if v is not None]
        message = f"{what} ({', '.join(where)})" if where else what
        return cls(False, FailureClass(failure), message, rank, shape, seed, detail)


def merge_rank_verdicts(verdicts: list[Verdict]) -> Verdict:
    """One verdict from every rank's: the lowest failing rank wins; all passing -> rank 0's."""
    if not verdicts:
        raise ValueError("no rank verdicts to merge")
    return next((v for v in verdicts if not v.ok), verdicts[0])
