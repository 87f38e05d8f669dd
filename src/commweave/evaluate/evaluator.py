"""The cascade: compile -> correctness -> benchmark side by side with the baselines -> fitness.

The calling process only parses and compiles programs (nvcc; cubins land in the disk cache the
program processes' `ctx.compile` reads). The pool's workers are the judges (`commweave.evaluate.
jobs`); every program runs in program processes of its own, started per job. Every failure path
gives fitness 0, a failure class and a message; what a candidate did outside its own processes
(a judge killed, a baseline failing beside it) is `tampering`, and what the machine did (nothing
could start, a fresh pool cannot judge a baseline either) raises InfrastructureError. Fitness is
the first usable baseline's median time over the candidate's, measured in one job.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import replace

from commweave.evaluate.floor import MachineRates, below_floor, floor_s
from commweave.evaluate.jobs import RankBench, RankCheck, RankEvaluation, resolve_workload, workload_ref
from commweave.contracts.program import ProgramError, parse_program
from commweave.evaluate.timing import summarize
from commweave.contracts.result import BenchResult, EvalResult, ProgramTiming
from commweave.contracts.verdict import (
    EvaluationError, FailureClass, InfrastructureError, Verdict, merge_rank_verdicts,
)
from commweave.runtime.compile import CompileError, compile_cubin
from commweave.runtime.toolchain import ToolchainError
from commweave.runtime.pool import JobResult, WorkerPool, host_oom_kills, is_out_of_memory
from commweave.contracts.workload import Shape, Workload

CHECK_JOB = "commweave.evaluate.jobs:check_program"
BENCH_JOB = "commweave.evaluate.jobs:bench_programs"
EVALUATE_JOB = "commweave.evaluate.jobs:evaluate_program"  # check, then benchmark: one job, one start
CANDIDATE = "candidate"  # the candidate's name in a benchmark beside the baselines
JUDGE_SHARE = 0.8  # of a job's time limit, what its judges give its programs (then they report a timeout)
#: said of a failure while the host's out-of-memory killer struck (/proc/vmstat's oom_kill rose)
HOST_OUT_OF_MEMORY = "the host's out-of-memory killer struck during the evaluation"


def job_failure(result: JobResult) -> Verdict:
    """The verdict for a job that did not finish on every rank (the pool restarted if it hung,
    crashed or broke a CUDA context)."""
    restarted = "; the worker pool was restarted" if result.restarted else ""
    if result.status == "timeout":
        silent = [str(r) for r, f in enumerate(result.failures) if f is not None]
        return Verdict(False, FailureClass.TIMEOUT, f"no answer within {result.elapsed_s:.1f} s from rank "
                                                    f"{', '.join(silent)} (deadlock or endless loop){restarted}")
    cause = result.cause()
    if cause is None:
        raise ValueError("job_failure() needs a failed job")
    rank, failure = cause
    if failure.error_type == "WorkloadError":
        raise EvaluationError(failure.message)
    if failure.error_type == "ProgramStartError":
        raise InfrastructureError(f"rank {rank}: {failure.message}")
    if failure.error_type == "tampering":
        return Verdict(False, FailureClass.TAMPERING, f"a judge process died while it ran ({failure.message}); a fresh "
                       f"pool judges the baseline correctly{restarted}", rank=rank)
    if failure.error_type == "crashed":
        what = failure.message
    elif failure.error_type == "HarnessError":
        what = f"the harness failed after candidate code ran: {failure.message}"
    else:
        what = f"{failure.error_type}: {failure.message}"
    cls = FailureClass.ILLEGAL_ADDRESS if failure.sticky else FailureClass.RUNTIME_ERROR
    return Verdict(False, cls, what + restarted, rank=rank, detail=failure.traceback)


def _noting_host_memory(verdict: Verdict, host_ran_out: bool) -> Verdict:
    """A program that died or stalled while the host ran out of memory: said in its message (a
    machine too small for the problem reads apart from a crash; PKB #76-78 on a 24 GB host)."""
    if not host_ran_out or verdict.failure not in (FailureClass.RUNTIME_ERROR, FailureClass.TIMEOUT):
        return verdict
    return replace(verdict, message=f"{verdict.message} ({HOST_OUT_OF_MEMORY})")


def fresh_seed_base() -> int:
    """A new random base per evaluation, so no program can memorise its inputs."""
    return secrets.randbelow(1 << 30)


class Evaluator:
    """Judges programs of one workload on one pool."""

    def __init__(self, pool: WorkerPool, workload: Workload, *, seeds: int = 3, warmup: int = 5, iters: int = 20,
                 rates: MachineRates | None = None, job_timeout_s: float | None = None,
                 fitness_baseline_only: bool = False):
        if seeds < 2:
            raise ValueError(f"seeds must be >= 2 (consecutive runs on fresh inputs catch cached outputs), got {seeds}")
        if warmup < 0 or iters < 1:
            raise ValueError(f"need warmup >= 0 and iters >= 1, got {warmup} and {iters}")
        workload.check_world_size(pool.world_size)
        if CANDIDATE in workload.baselines:
            raise ValueError(f"workload {workload.name!r} names a baseline {CANDIDATE!r}, which is reserved for the candidate")
        self.pool = pool
        self.workload = workload
        self.workload_ref = workload_ref(workload)
        resolve_workload(self.workload_ref)  # fail here, not in every job, if it cannot be rebuilt
        self.seeds = seeds
        self.warmup = warmup
        self.iters = iters
        self.rates = rates or MachineRates()
        self.job_timeout_s = job_timeout_s
        #: `evaluate` times beside the candidate only the baseline its fitness is measured against
        #: (the first that passes its checks), not every baseline: a search's choice, one program
        #: process and a third of the benchmark less per candidate with two baselines
        self.fitness_baseline_only = fitness_baseline_only
        self._baseline_checks: dict[tuple[str, tuple[str, ...]], Verdict] = {}
        #: where the judges' time went in the last `evaluate` (or check/benchmark since): seconds
        #: per phase (program process start, process group init, setup, checks, timing), the
        #: largest over ranks, summed over jobs
        self.phases: dict[str, float] = {}

    @property
    def world_size(self) -> int:
        return self.pool.world_size

    # -- stages ---------------------------------------------------------------------------------
    @staticmethod
    def compile_source(source: str) -> object:
        """nvcc for one CUDA source into the disk cache the workers read (the search runs it ahead)."""
        return compile_cubin(source)

    def compile(self, text: str) -> Verdict:
        """Parse, then compile every CUDA source (never executes the program). On CPU workers, which
        run no CUDA, a machine without nvcc or NCCL's headers (the main install has neither) skips
        the compiles instead of failing: a CPU dry run needs no CUDA toolchain."""
        try:
            parsed = parse_program(text)
        except ProgramError as exc:
            return Verdict.failed(FailureClass.COMPILE_ERROR, str(exc))
        for name, source in parsed.cuda_sources.items():
            try:
                compile_cubin(source)
            except CompileError as exc:
                return Verdict.failed(FailureClass.COMPILE_ERROR, f"{name}: {exc}\n{exc.log}")
            except ToolchainError as exc:
                if self.pool.device != "cpu":
                    raise
                return Verdict.passed(f"{len(parsed.cuda_sources)} CUDA source(s) not compiled on CPU workers ({exc})")
        return Verdict.passed(f"{len(parsed.cuda_sources)} CUDA source(s) compiled")

    def check(self, text: str, shapes: list[Shape] | None = None) -> Verdict:
        """Compile, then correctness on `shapes` (default: the workload's check shapes)."""
        return self._check(text, CANDIDATE, shapes if shapes is not None else self.workload.check_shapes(self.world_size))

    @property
    def _timeout_s(self) -> float:
        return self.job_timeout_s if self.job_timeout_s is not None else self.pool.job_timeout_s

    def _run(self, job: str, candidate: bool, phases: int = 1, **kwargs: object) -> JobResult:
        """Run a judge job (`phases`: how many jobs' worth of time it gets); a judge that died
        while a candidate's processes ran is the candidate's doing if a fresh pool then judges a
        baseline correctly (else the machine's: raised)."""
        timeout_s = phases * self._timeout_s
        result = self.pool.run(job, timeout_s=timeout_s, budget_s=JUDGE_SHARE * timeout_s, **kwargs)
        slowest: dict[str, float] = {}
        for values in result.values:
            for phase, seconds in getattr(values, "phases", {}).items():
                slowest[phase] = max(slowest.get(phase, 0.0), seconds)
        for phase, seconds in slowest.items():
            self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        cause = result.cause()
        if result.ok or cause is None or cause[1].error_type != "crashed":
            return result
        if not candidate:
            raise InfrastructureError(f"a judge process died judging trusted programs: {cause[1].message}")
        probe_name = self.workload.baselines[0]
        probe = self._check(self.workload.program_text(probe_name), probe_name,
                            self.workload.check_shapes(self.world_size)[:1], candidate=False)
        if probe.failure in (None, FailureClass.UNAVAILABLE):
            result.failures[cause[0]].error_type = "tampering"
            return result
        raise InfrastructureError(f"a judge process died ({cause[1].message}) and a fresh pool cannot judge "
                                  f"baseline {probe_name!r} either: {probe.failure}: {probe.message}")

    def _check(self, text: str, name: str, shapes: list[Shape], candidate: bool = True) -> Verdict:
        verdict = self.compile(text)
        if not verdict.ok:
            return verdict
        base = fresh_seed_base()
        result = self._run(CHECK_JOB, candidate, workload=self.workload_ref, text=text, name=name,
                           shapes=list(shapes), seeds=[base + i for i in range(self.seeds)])
        if not result.ok:
            return job_failure(result)
        ranks: list[RankCheck] = result.values
        return merge_rank_verdicts([r.verdict for r in ranks])

    def benchmark(self, programs: dict[str, str], shape: Shape) -> BenchResult:
        """Time `programs` side by side in one job; each gets a verdict (and times if it ran).
        A job that fails as a whole gives its failure to every program in it."""
        failed, runnable = self._compiled(programs)
        ranks: list[RankBench] | Verdict = []
        if runnable:
            result = self._run(BENCH_JOB, CANDIDATE in runnable, workload=self.workload_ref, programs=runnable,
                               shape=shape, warmup=self.warmup, iters=self.iters)
            ranks = result.values if result.ok else job_failure(result)
        return self._bench_result(programs, failed, runnable, ranks, shape)

    def _compiled(self, programs: dict[str, str]) -> tuple[dict[str, ProgramTiming], dict[str, str]]:
        """(the programs that failed to compile, with their verdicts; those that compiled)."""
        failed: dict[str, ProgramTiming] = {}
        runnable: dict[str, str] = {}
        for name, text in programs.items():
            verdict = self.compile(text)
            if verdict.ok:
                runnable[name] = text
            else:
                failed[name] = ProgramTiming(name, verdict)
        return failed, runnable

    def _bench_result(self, programs: dict[str, str], failed: dict[str, ProgramTiming], runnable: dict[str, str],
                      ranks: list[RankBench] | Verdict, shape: Shape) -> BenchResult:
        """The benchmark of `programs` from the ranks' results, or one failure for all of `runnable`."""
        floor = floor_s(self.workload.cost(shape, self.world_size), self.rates)
        timings = dict(failed)
        input_sets = 0
        for name in runnable:
            if isinstance(ranks, Verdict):
                timings[name] = ProgramTiming(name, ranks)
            else:
                input_sets = ranks[0].input_sets
                timings[name] = self._timing(name, ranks, floor)
        ordered = {name: timings[name] for name in programs}
        return BenchResult(shape.label, floor * 1e6, self.warmup, self.iters, input_sets, ordered)

    @staticmethod
    def _timing(name: str, ranks: list[RankBench], floor: float) -> ProgramTiming:
        verdict = merge_rank_verdicts([r.verdicts[name] for r in ranks])
        if not all(name in r.times for r in ranks):
            return ProgramTiming(name, verdict)
        timing = summarize(name, verdict, [r.times[name] for r in ranks])
        if all(name in r.memory for r in ranks):
            timing.memory_bytes = max(r.memory[name] for r in ranks)
        if all(name in r.batch for r in ranks):
            timing.batch = ranks[0].batch[name]
            timing.crossing_us = max(r.crossing[name] for r in ranks) * 1e6
            timing.subtracted_us = ranks[0].subtracted * 1e6
            timing.hold_expired = max(r.expired.get(name, 0) for r in ranks)
        if verdict.ok:
            timing.verdict = below_floor(timing.median_us * 1e-6, floor) or verdict
        return timing

    # -- the cascade ----------------------------------------------------------------------------
    def evaluate(self, text: str, shape: Shape) -> EvalResult:
        """compile -> check (check shapes + `shape`) -> benchmark beside the baselines -> fitness."""
        self.phases = {}
        shapes = self.workload.check_shapes(self.world_size)
        if shape not in shapes:
            shapes = [*shapes, shape]
        verdict = self.compile(text)
        if not verdict.ok:
            return EvalResult(0.0, verdict, shape.label)
        baselines: dict[str, ProgramTiming] = {}
        to_time: dict[str, str] = {CANDIDATE: text}
        for name in self.workload.baselines:
            baseline_text = self.workload.program_text(name)
            baseline_verdict = self._baseline_check(name, baseline_text, shapes)
            if baseline_verdict.ok:
                to_time[name] = baseline_text
                if self.fitness_baseline_only:
                    break
            else:
                baselines[name] = ProgramTiming(name, baseline_verdict)
        failed, runnable = self._compiled({n: t for n, t in to_time.items() if n != CANDIDATE})
        base = fresh_seed_base()
        oom_kills = host_oom_kills()
        result = self._run(EVALUATE_JOB, True, phases=2, workload=self.workload_ref, name=CANDIDATE, text=text,
                           baselines=runnable, check_shapes=shapes, seeds=[base + i for i in range(self.seeds)],
                           shape=shape, warmup=self.warmup, iters=self.iters)
        host_ran_out = oom_kills is not None and (host_oom_kills() or 0) > oom_kills
        if not result.ok:
            return EvalResult(0.0, _noting_host_memory(job_failure(result), host_ran_out), shape.label)
        ranks: list[RankEvaluation] = result.values
        verdict = merge_rank_verdicts([r.verdict for r in ranks])
        if not verdict.ok:
            return EvalResult(0.0, _noting_host_memory(verdict, host_ran_out), shape.label)
        benches = [r.bench for r in ranks if r.bench is not None]
        bench = self._bench_result(to_time, failed, {CANDIDATE: text, **runnable}, benches, shape)
        candidate = bench.programs[CANDIDATE]
        sabotaged = [n for n in to_time if n != CANDIDATE and not bench.programs[n].verdict.ok]
        late = [n for n in sabotaged if bench.programs[n].verdict.failure == FailureClass.TIMEOUT]
        if late and candidate.verdict.ok:  # the job's time ran out: a slow candidate, no sabotage
            blame = Verdict.failed(FailureClass.TIMEOUT, f"the benchmark ran out of time beside it (baseline "
                                   f"{late[0]!r}: {bench.programs[late[0]].verdict.message})")
            candidate = ProgramTiming(CANDIDATE, blame)
        elif sabotaged and candidate.verdict.ok:
            alone = self.benchmark({n: to_time[n] for n in sabotaged}, shape)
            cleared = [n for n in sabotaged if alone.programs[n].verdict.ok]
            if cleared:
                n = cleared[0]
                why = f"({bench.programs[n].verdict.failure}: {bench.programs[n].verdict.message})"
                if is_out_of_memory(bench.programs[n].verdict.message) or host_ran_out:  # memory ran out: no evidence of intent
                    where = "the host's out-of-memory killer struck" if host_ran_out else "the device ran out of memory"
                    blame = Verdict.failed(FailureClass.RUNTIME_ERROR, f"{where} with it beside the baselines: "
                                           f"baseline {n!r} failed beside it {why} and passes alone")
                else:
                    blame = Verdict.failed(FailureClass.TAMPERING, f"baseline {n!r} failed beside it {why} and passes alone")
                candidate = ProgramTiming(CANDIDATE, blame)
        baselines = {name: baselines[name] if name in baselines else bench.programs[name]
                     for name in self.workload.baselines if name in baselines or name in bench.programs}
        if not candidate.verdict.ok:
            return EvalResult(0.0, _noting_host_memory(candidate.verdict, host_ran_out), shape.label, candidate, None,
                              baselines, bench.floor_us)
        reference = next((n for n, t in baselines.items() if t.verdict.ok), None)
        if reference is None:
            why = "; ".join(f"{n}: {t.verdict.failure}: {t.verdict.message}" for n, t in baselines.items())
            raise EvaluationError(f"no baseline of {self.workload.name!r} could be timed on {shape}: {why}")
        fitness = baselines[reference].median_us / candidate.median_us
        return EvalResult(fitness, verdict, shape.label, candidate, reference, baselines, bench.floor_us)

    def _baseline_check(self, name: str, text: str, shapes: list[Shape]) -> Verdict:
        """A baseline is checked once per text and shape set (it does not change between candidates)."""
        key = (hashlib.sha256(text.encode()).hexdigest(), tuple(s.label for s in shapes))
        if key not in self._baseline_checks:
            self._baseline_checks[key] = self._check(text, name, shapes)
        return self._baseline_checks[key]
