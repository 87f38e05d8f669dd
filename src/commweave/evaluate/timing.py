"""Timing: batches of calls, how large, how they are scheduled, and how times are summarised.

The judge times a *batch*: K calls back to back, each on an input set of its own filled with fresh
values and into an output of its own, between one start and one end on the judge's side, so the
crossings between judge and program process (a request, an answer, IPC events; ~0.3-1 ms) land
once per batch instead of once per call. K is chosen from probe batches so that a batch lasts at
least `BATCH_TARGET_S`, bounded by memory (K input sets and outputs) and `MAX_BATCH`, and is then
the same for every program of a benchmark (`common_sizes`); a batch's per-call time is its time
less the smallest program's crossing (measured per run), over K. A multi-GPU call is as slow as its
slowest rank, so each batch's per-call time is the maximum over ranks, and a program's time is the
median of those maxima (min and p90 are kept for spread). Programs' batches alternate in one job,
the order of programs rotating every round, so clock and thermal drift fall on all of them alike.
"""

from __future__ import annotations

import math
import statistics

from commweave.contracts.profile import H200
from commweave.contracts.result import ProgramTiming
from commweave.contracts.verdict import Verdict

MAX_INPUT_SETS = 16
MAX_ROTATION_BYTES = 8 << 30
INTERLEAVE_BLOCK = 1  # batches of one program in a row before the next program's turn
#: a timed batch lasts at least this long on the judge's clock: the per-batch crossings (measured
#: and recorded per run as the judge's resolution) are then a few percent of it or less
BATCH_TARGET_S = {"cuda": 0.012, "cpu": 0.025}
#: the most calls in a batch (on GPUs also what a program may queue behind the judge's hold)
MAX_BATCH = {"cuda": 1024, "cpu": 256}
#: how much longer than the target a slow program's batch may grow to hold its benchmark's common K
MAX_BATCH_STRETCH = 8.0
#: memory for one program's batch (K input sets and outputs, with the judge's staging on GPUs),
#: at most this and at most `BATCH_MEMORY_SHARE` of what the device has free over the programs
BATCH_BYTES = {"cuda": 8 << 30, "cpu": 256 << 20}
BATCH_MEMORY_SHARE = 0.5
#: probe batches of one call each, per program, before the warm-up batches that size K
PROBE_BATCHES = 3
#: outputs of each timed batch judged against the reference, picked by the judge after the batch
#: (no program can tell which): a program that skips its work in a fraction f of calls passes B
#: batches with probability (1 - f)^(VERIFY_PER_BATCH * B); every output is checked for poison
VERIFY_PER_BATCH = 4


def batch_capacity(call_bytes: int, budget_bytes: int, device: str) -> int:
    """The most calls a batch can hold when each needs `call_bytes` (its inputs, its output)."""
    return max(1, min(MAX_BATCH[device], budget_bytes // max(1, call_bytes)))


def batch_size(per_call_s: float, capacity: int, device: str, stretch: float = 1.0) -> int:
    """Calls per batch so that a batch lasts `stretch` x `BATCH_TARGET_S` at `per_call_s`, within
    1..capacity."""
    if not per_call_s > 0:
        return capacity
    return max(1, min(capacity, math.ceil(stretch * BATCH_TARGET_S[device] / per_call_s)))


def common_sizes(sizes: dict[str, int], per_call_s: dict[str, float], capacity: int, device: str) -> dict[str, int]:
    """One K for the programs of a benchmark, the largest any of them drew: each then pays the same
    crossing per call, so an honest copy cannot read faster for a K rounded up from a noisy probe
    (ceil(25 ms / 16 ms) = 2 against ceil(25 ms / 26 ms) = 1 read 1.47x on CPU). A program whose
    batches would then last over `MAX_BATCH_STRETCH` x the target keeps the most that fits that."""
    common = max(sizes.values(), default=1)
    return {name: max(size, min(common, batch_size(per_call_s.get(name, 0.0), capacity, device, MAX_BATCH_STRETCH)))
            for name, size in sizes.items()}


def net_seconds(batch_s: float, crossing_s: float) -> float:
    """A batch's time less the crossing the judge takes off every batch of a benchmark (the smallest
    program's, which no program can raise for itself: lowering its own only lowers everyone's);
    never below half the batch, so a noisy crossing cannot turn a batch into nothing."""
    return max(batch_s - crossing_s, 0.5 * batch_s)


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
