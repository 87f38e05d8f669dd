"""Timing: how iterations are scheduled, how many input sets rotate, and how times are summarised.

A multi-GPU call is as slow as its slowest rank, so each iteration's time is the maximum over
ranks, and a program's time is the median of those maxima (min and p90 are kept for spread).
Programs are timed side by side in one job, interleaved in round-robin blocks whose order rotates
every round, so clock and thermal drift fall on all of them alike.
"""

from __future__ import annotations

import math
import statistics

from commweave.contracts.profile import H200
from commweave.contracts.result import ProgramTiming
from commweave.contracts.verdict import Verdict

MAX_INPUT_SETS = 16
MAX_ROTATION_BYTES = 8 << 30
INTERLEAVE_BLOCK = 5  # iterations of one program in a row before the next program's turn
#: a timed iteration's output is judged with probability 1/VERIFY_ONE_IN (decided by the judge after
#: the run, so no program can tell which ones count), and the last one always: a program that skips
#: its work in k timed iterations (a stale output) passes with probability 2^-k, and moving the
#: median takes k >= iters / 2
VERIFY_ONE_IN = 2


def input_sets_for(set_bytes: int) -> int:
    """Enough rotating input sets that together they exceed 2x L2, at least 2, memory capped."""
    wanted = math.ceil(2 * H200.l2_bytes / max(1, set_bytes))
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
