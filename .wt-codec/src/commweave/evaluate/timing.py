"""Timing: how iterations are scheduled, how many input sets rotate, and how times are summarised.

A multi-GPU call is as slow as its slowest rank, so each iteration's time is the maximum over
ranks, and a program's time is the median of those maxima (min and p90 are kept for spread).
Programs are timed side by side in one job, interleaved in round-robin blocks whose order rotates
every round, so clock and thermal drift fall on all of them alike.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from commweave.evaluate.verdict import Verdict

L2_BYTES = 50 << 20  # H200 L2: rotating inputs past twice this size means no run finds them cached
MAX_INPUT_SETS = 16
MAX_ROTATION_BYTES = 8 << 30
INTERLEAVE_BLOCK = 5  # iterations of one program in a row before the next program's turn


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


@dataclass
class BenchResult:
    shape: str
    floor_us: float
    warmup: int
    iters: int
    input_sets: int  # how many rotating input sets the job used (0 if it never got that far)
    programs: dict[str, ProgramTiming]


def input_sets_for(set_bytes: int) -> int:
    """Enough rotating input sets that together they exceed 2x L2, at least 2, memory capped."""
    wanted = math.ceil(2 * L2_BYTES / max(1, set_bytes))
    affordable = MAX_ROTATION_BYTES // max(1, set_bytes)
    return max(2, min(wanted, MAX_INPUT_SETS, affordable))


def interleaved_schedule(names: list[str], iters: int, block: int = INTERLEAVE_BLOCK) -> list[tuple[str, int]]:
    """(program, iteration) pairs: blocks of `block` iterations per program, round-robin, the order
    of programs rotating by one each round."""
    schedule: list[tuple[str, int]] = []
    for round_index, begin in enumerate(range(0, iters, block)):
        shift = round_index % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            schedule.extend((name, i) for i in range(begin, min(iters, begin + block)))
    return schedule


def per_iteration_max(times_per_rank: list[list[float]]) -> list[float]:
    """Each iteration's time across ranks: the slowest rank's."""
    lengths = {len(t) for t in times_per_rank}
    if len(lengths) != 1:
        raise ValueError(f"ranks timed different numbers of iterations: {sorted(lengths)}")
    return [max(column) for column in zip(*times_per_rank)]


def summarize(name: str, verdict: Verdict, times_per_rank_s: list[list[float]]) -> ProgramTiming:
    """Median, min and p90 (in µs) of the per-iteration maxima over ranks."""
    per_iter = [t * 1e6 for t in per_iteration_max(times_per_rank_s)]
    if not per_iter:
        raise ValueError(f"{name}: no timed iterations")
    ordered = sorted(per_iter)
    p90 = ordered[math.ceil(0.9 * len(ordered)) - 1]
    return ProgramTiming(name, verdict, statistics.median(per_iter), ordered[0], p90, per_iter)


def gated_seconds(ctx: Any, fn: Callable[[], object], after: Callable[[], Any] | None = None) -> tuple[float, Any]:
    """One multi-rank timed region on GPUs: the stream is held until `fn()` is queued
    (`ctx.hold_stream`), the ranks are lined up by a device barrier, then `fn()` runs between two
    events, so the time is the GPUs' own, not the hosts' launch time or their skew. `after()` is
    queued right after the end event (what the timer saw); returns (seconds, its result)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    release = ctx.hold_stream()
    ctx.device_barrier()
    start.record()
    fn()
    end.record()
    release()
    seen = after() if after is not None else None
    torch.cuda.synchronize(ctx.device)
    return start.elapsed_time(end) * 1e-3, seen


HOLD_CYCLES = 2_000_000  # ~1 ms of GPU clock: longer than the host takes to queue a probe's launches


def cuda_median_us(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median GPU time of `fn()` on the current stream in µs over `iters` calls (CUDA events),
    after `warmup` untimed ones: the one-GPU timer of probes and kernel tests (multi-rank calls:
    `gated_seconds`). Each timed call is queued behind a ~1 ms spin kernel, so its launches are
    all queued before the start event fires: the time is the GPU's, not the host's launch latency
    (without the hold, a 50 µs kernel launched from Python measured ~90 µs)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(HOLD_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)
