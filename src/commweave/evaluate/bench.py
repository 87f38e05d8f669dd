"""One bench path: check programs, then time them side by side per shape, beside yardsticks,
against the floor, and return a typed report.

`commweave bench`, bench/sweep.py and bench/sweep_kv.py all call `bench_workload`; what they print
is rendered from its `BenchReport` (`commweave.report.bench`), and `BenchReport.to_json()` is their
results file. Every figure derived from the timings (speedups, fractions of the floor and of the
yardsticks, bandwidths) is computed here, from the timings of one job, so all of them compare
programs measured side by side.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from commweave.contracts.result import ProgramTiming
from commweave.contracts.verdict import Verdict
from commweave.contracts.workload import Shape, Workload
from commweave.evaluate.evaluator import Evaluator
from commweave.evaluate.floor import MachineRates, calibrate, floor_s
from commweave.runtime.pool import WorkerPool
from commweave.runtime.provenance import Provenance


@dataclass
class ShapeBench:
    """One benchmark job: programs (and yardsticks) timed side by side on one shape.

    `checks` holds each checked program's correctness verdict for this shape (a failure on the
    check shapes is carried here too); `timings` every program and yardstick the job timed. A
    yardstick's time counts whatever its verdict (it skips work on purpose); a program's only when
    it passed its checks and the benchmark's own judgement of its output."""

    shape: str
    comm_bytes: float  # what the slowest rank receives in one call (the workload's cost)
    floor_us: float
    programs: list[str]  # this job's programs (timed or failed), yardsticks left out
    baselines: list[str]  # the report's baselines, in the workload's order
    yardsticks: list[str]
    checks: dict[str, Verdict] = field(default_factory=dict)
    timings: dict[str, ProgramTiming] = field(default_factory=dict)
    input_sets: int = 0

    def verdict(self, name: str) -> Verdict | None:
        """A program's verdict here: its check's failure, else its benchmark's verdict, else its
        check's pass; None when it was neither checked nor timed."""
        check = self.checks.get(name)
        if check is not None and not check.ok:
            return check
        timing = self.timings.get(name)
        return timing.verdict if timing is not None else check

    def median_us(self, name: str) -> float | None:
        """The median of the per-iteration maxima over ranks, where it counts (see the class)."""
        timing = self.timings.get(name)
        if timing is None or not timing.median_us:
            return None
        if name in self.yardsticks:
            return timing.median_us
        verdict = self.verdict(name)
        return timing.median_us if verdict is not None and verdict.ok else None

    @property
    def baseline(self) -> str | None:
        """The fitness baseline: the first baseline with a time (the Evaluator's rule)."""
        return next((b for b in self.baselines if self.median_us(b)), None)

    @property
    def best_baseline(self) -> str | None:
        """The fastest baseline with a time."""
        timed = [b for b in self.baselines if self.median_us(b)]
        return min(timed, key=lambda b: self.median_us(b)) if timed else None

    def ratio(self, numerator: str, denominator: str) -> float | None:
        """median(numerator) / median(denominator), where both have a time."""
        top, bottom = self.median_us(numerator), self.median_us(denominator)
        return top / bottom if top and bottom else None

    def speedup(self, name: str, over: str | None = None) -> float | None:
        """How many times faster `name` is than baseline `over` (default: the fitness baseline)."""
        over = over or self.baseline
        return self.ratio(over, name) if over is not None else None

    def floor_fraction(self, name: str) -> float | None:
        """floor / median: 1 is the physical limit."""
        us = self.median_us(name)
        return self.floor_us / us if us else None

    def gbps(self, name: str) -> float | None:
        """The rate at which the call's received bytes moved, GB/s (`comm_bytes` over the median)."""
        us = self.median_us(name)
        return self.comm_bytes / us / 1e3 if us else None

    def memory_bytes(self) -> dict[str, int]:
        """Device memory per GPU beyond inputs and output, per timed name (GPUs only)."""
        return {n: t.memory_bytes for n, t in self.timings.items() if t.memory_bytes is not None}

    def to_json(self, comm_yardsticks: Sequence[str], link_bytes_per_s: float) -> dict[str, Any]:
        programs = {}
        for name in self.programs:
            timing, verdict = self.timings.get(name), self.verdict(name)
            programs[name] = {
                "verdict": asdict(verdict) if verdict is not None else None,
                "check": asdict(self.checks[name]) if name in self.checks else None,
                "timing": asdict(timing) if timing is not None else None,
                "speedup": {b: self.speedup(name, b) for b in self.baselines if b != name and self.speedup(name, b)},
                "floor_fraction": self.floor_fraction(name),
                "yardstick_fraction": {y: self.ratio(y, name) for y in self.yardsticks if self.ratio(y, name)},
            }
        yardsticks = {}
        for name in self.yardsticks:
            timing = self.timings.get(name)
            entry: dict[str, Any] = {"median_us": self.median_us(name),
                                     "timing": asdict(timing) if timing is not None else None}
            if name in comm_yardsticks:
                gbps = self.gbps(name)
                entry |= {"GBps": gbps, "of_link": gbps * 1e9 / link_bytes_per_s if gbps else None}
            yardsticks[name] = entry
        return {"shape": self.shape, "comm_bytes": self.comm_bytes, "floor_us": self.floor_us,
                "input_sets": self.input_sets, "baseline": self.baseline, "best_baseline": self.best_baseline,
                "programs": programs, "yardsticks": yardsticks}


@dataclass
class BenchReport:
    """Programs of one workload checked and timed side by side on a pool: one `ShapeBench` per job
    (one per shape, or several when the programs are timed in batches), with provenance."""

    workload: str
    gpus: int
    programs: list[str]
    baselines: list[str]  # the workload's baselines among `programs`, in its order; the first usable is fitness's
    yardsticks: dict[str, tuple[str, dict[str, Any]]]  # name -> (program, CONFIG overrides), the workload's
    comm_yardsticks: list[str]  # yardsticks that only move the call's data: their GB/s are reported
    iters: int
    warmup: int
    seeds: int
    rates: MachineRates
    provenance: Provenance
    check_shapes: list[str]
    checks: dict[str, Verdict] = field(default_factory=dict)  # on the check shapes
    rows: list[ShapeBench] = field(default_factory=list)
    complete: bool = False  # False while running, or when cut short
    meta: dict[str, Any] = field(default_factory=dict)  # the caller's own facts (candidate file, swept grid)

    def shapes(self) -> list[str]:
        return list(dict.fromkeys(row.shape for row in self.rows))

    def failures(self) -> list[tuple[str, str, Verdict]]:
        """(shape, program, verdict) for every program that failed, once per shape."""
        seen: dict[tuple[str, str], Verdict] = {}
        for row in self.rows:
            for name in row.programs:
                verdict = row.verdict(name)
                if verdict is not None and not verdict.ok:
                    seen.setdefault((row.shape, name), verdict)
        return [(shape, name, verdict) for (shape, name), verdict in seen.items()]

    def to_json(self) -> dict[str, Any]:
        """Provenance, settings, rates, checks and every row, as plain JSON."""
        return {**self.provenance.to_json(), "workload": self.workload, "gpus": self.gpus, "iters": self.iters,
                "warmup": self.warmup, "seeds": self.seeds, "rates": asdict(self.rates), "programs": self.programs,
                "baselines": self.baselines, "yardsticks": {n: list(d) for n, d in self.yardsticks.items()},
                "comm_yardsticks": self.comm_yardsticks, "check_shapes": self.check_shapes,
                "checks": {n: asdict(v) for n, v in self.checks.items()}, "complete": self.complete, **self.meta,
                "rows": [row.to_json(self.comm_yardsticks, self.rates.link_bytes_per_s) for row in self.rows]}


@dataclass(frozen=True)
class BenchStep:
    """What `bench_workload` is about to do (`done` of `total` steps), with the report so far."""

    description: str
    done: int
    total: int
    report: BenchReport | None  # None before calibrating


def _batches(names: list[str], size: int | None) -> list[list[str]]:
    """`names` in groups of at most `size` (None: one group); no names, no groups."""
    size = size or max(1, len(names))
    return [names[i:i + size] for i in range(0, len(names), size)]


def bench_workload(pool: WorkerPool, workload: Workload, shapes: Sequence[Shape], programs: Mapping[str, str], *,
                   yardsticks: Sequence[str] = (), iters: int = 20, warmup: int = 5, seeds: int = 2,
                   job_timeout_s: float | None = None, rates: MachineRates | None = None,
                   check_shapes: Sequence[Shape] | None = None, check_each_shape: bool = True,
                   batch: int | None = None, command: Sequence[str] | None = None,
                   meta: Mapping[str, Any] | None = None,
                   progress: Callable[[BenchStep], None] | None = None) -> BenchReport:
    """Check `programs` (name -> text; the workload's baselines among them are the baselines), then
    time them per shape side by side with the workload's `yardsticks` (timed, never checked).

    Checks: every program on `check_shapes` (default: the workload's; empty: none), then, with
    `check_each_shape`, each survivor on each timed shape before it is timed there. A program that
    fails is not timed. `batch`: at most this many non-baseline programs per job, each job with
    every baseline and yardstick (for sweeps whose programs would not fit in memory together).
    `rates`: the machine's (default: `calibrate(pool)`). `command`: the provenance's command line.
    `progress` hears of each step before it runs, with the report so far, which is filled in place
    (`complete` is set last), so a caller cut short can still write what was measured."""
    world = pool.world_size
    workload.check_world_size(world)
    if not programs or not shapes:
        raise ValueError(f"nothing to bench: {len(programs)} programs on {len(shapes)} shapes")
    unknown = [y for y in yardsticks if y not in workload.yardsticks]
    if unknown:
        raise ValueError(f"workload {workload.name!r} has no yardstick {', '.join(unknown)} "
                         f"(has: {', '.join(workload.yardsticks) or 'none'})")
    clash = sorted(set(yardsticks) & set(programs))
    if clash:
        raise ValueError(f"{', '.join(clash)} is both a program and a yardstick")
    if batch is not None and batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    small = list(workload.check_shapes(world) if check_shapes is None else check_shapes)
    baselines = [b for b in workload.baselines if b in programs]
    others = [n for n in programs if n not in baselines]
    # the jobs per shape shrink as programs fail their checks; `total` assumes none fails until then
    jobs_per_shape = len(_batches(others, batch)) or 1
    total = (rates is None) + bool(small) + len(shapes) * (check_each_shape + jobs_per_shape)
    done = 0

    def step(description: str, report: BenchReport | None) -> None:
        nonlocal done
        if progress is not None:
            progress(BenchStep(description, done, total, report))
        done += 1

    if rates is None:
        step("calibrating matmul, link and HBM rates", None)
        rates = calibrate(pool, timeout_s=job_timeout_s)
    evaluator = Evaluator(pool, workload, seeds=seeds, warmup=warmup, iters=iters, rates=rates,
                          job_timeout_s=job_timeout_s)
    report = BenchReport(workload.name, world, list(programs), baselines,
                         {y: workload.yardsticks[y] for y in yardsticks}, [y for y in yardsticks if y in workload.comm_yardsticks],
                         iters, warmup, seeds, rates, Provenance.now(command), [s.label for s in small],
                         meta=dict(meta or {}))
    if small:
        step(f"checking {len(programs)} programs on {len(small)} check shapes", report)
        report.checks = {name: evaluator.check(text, small) for name, text in programs.items()}
    yard_texts = {y: workload.yardstick_text(y) for y in yardsticks}
    for shape in shapes:
        alive = [n for n in programs if n not in report.checks or report.checks[n].ok]
        checks = {n: v for n, v in report.checks.items() if not v.ok}
        if check_each_shape:
            step(f"{shape}: correctness", report)
            checks |= {n: evaluator.check(programs[n], [shape]) for n in alive}
            alive = [n for n in alive if checks[n].ok]
        groups = _batches([n for n in others if n in alive], batch) or [[]]
        total -= jobs_per_shape - len(groups)
        cost = workload.cost(shape, world)
        for index, group in enumerate(groups):
            # the failed programs go with the shape's first job, so every program has a verdict in a row
            members = [n for n in programs if n in baselines or n in group or (index == 0 and n not in alive)]
            names = [n for n in members if n in alive]
            row = ShapeBench(shape.label, cost.comm_bytes, floor_s(cost, rates) * 1e6, members, baselines,
                             list(yardsticks), {n: checks[n] for n in members if n in checks})
            step(f"{shape}: timing {len(names)} programs" + (f" and {len(yardsticks)} yardsticks" if yardsticks else ""),
                 report)
            if names:  # yardsticks alone compare with nothing
                result = evaluator.benchmark({n: programs[n] for n in names} | yard_texts, shape)
                row.timings, row.input_sets = dict(result.programs), result.input_sets
            report.rows.append(row)
    report.complete = True
    return report
