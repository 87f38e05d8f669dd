"""Judge-side jobs of the cascade: correctness check, side-by-side benchmark, rate calibration.

Each job runs on every rank in a judge process (`WorkerPool.run`), which never executes program
code: every program, candidate or baseline, runs in program processes of its own
(runtime/candidate.py; their side is evaluate/runner.py), one per rank, started for this job and
killed after it. The judge writes each run's inputs with fresh random values into buffers it owns
and shares with that program only (runtime/shared_buffers.py), poisons the output, asks for one
run, and reads, compares and times from its own side. Ranks stay in lockstep: after every request
all judges agree over their own gloo group whether a rank failed, and branch only on that
agreement; a judge whose program failed raises an abort flag, so peers waiting for a program
stuck in a collective stop waiting.

Workloads travel to judges as 'module:Class' paths (`workload_ref`): the class must be importable
there (the pool's PYTHONPATH) and constructible without arguments.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import random
import secrets
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from commweave.contracts.context import ProgramContext
from commweave.contracts.poison import poison_, poisoned_mask
from commweave.contracts.profile import H200
from commweave.contracts.verdict import FailureClass, HarnessError, Verdict, WorkloadError
from commweave.contracts.workload import Shape, Workload
from commweave.evaluate.checks import judge_output, modified_inputs, not_ready
from commweave.evaluate.runner import WorkEscapedStream
from commweave.evaluate.timing import (
    BATCH_BYTES, BATCH_MEMORY_SHARE, PROBE_BATCHES, VERIFY_PER_BATCH, batch_capacity, batch_size, common_sizes,
    interleaved_schedule, net_seconds,
)
from commweave.runtime.candidate import (
    ProgramProcess, ProgramStartError, confinement, make_rendezvous, remove_rendezvous,
)
from commweave.runtime.pool import is_sticky_cuda_error, resolve_function
from commweave.runtime.shared_buffers import SharedBuffers
from commweave.runtime.wire import WireError, decode_bytes, encode_bytes

SERVE = "commweave.evaluate.runner:serve"
_GROUP: Any = None  # this judge's harness group, created by the first job every rank runs


def _harness_group() -> Any:
    """A gloo group of the judges' own, for their agreements. Every job calls this first, so all
    ranks create it together."""
    global _GROUP
    if _GROUP is None:
        _GROUP = dist.new_group(backend="gloo")
    return _GROUP


def workload_ref(workload: Workload) -> str:
    """'module:Class' by which judges rebuild `workload`."""
    cls = type(workload)
    if "<locals>" in cls.__qualname__ or cls.__module__ == "__main__":
        raise ValueError(f"workload class {cls.__qualname__} must live at module level of an importable module")
    return f"{cls.__module__}:{cls.__qualname__}"


@functools.lru_cache(maxsize=None)
def resolve_workload(ref: str) -> Workload:
    try:
        return resolve_function(ref)()
    except Exception as exc:
        raise WorkloadError(f"workload {ref} cannot be built in this worker: {type(exc).__name__}: {exc} "
                           "(is its module on the pool's PYTHONPATH?)") from exc


def harness_output(ctx: ProgramContext, wl: Workload, shape: Shape) -> torch.Tensor:
    """This rank's output buffer as the harness makes it, for workload tests that run a program in
    their own process (the cascade itself gives program processes `SharedBuffers`).

    With `wl.symmetric_output` on a CUDA pool it lies in a symmetric window (`ctx.symmetric`), so a
    device program can store straight into its peers' outputs; this is collective (every rank calls
    it, in the same order), and every rank takes the largest rank's byte count so the windows match.
    The window returns to the context's free list at `ctx.end_candidate()`. Otherwise (CPU pools,
    other workloads) it is `make_output`'s tensor."""
    if not (wl.symmetric_output and ctx.is_cuda):
        return wl.make_output(shape, ctx.world_size, ctx.rank, ctx.device)
    nbytes = _symmetric_bytes(ctx, wl, shape)
    like = wl.make_output(shape, ctx.world_size, ctx.rank, torch.device("meta"))
    storage = ctx.symmetric((nbytes,), torch.uint8, zero=False)
    return storage[:like.numel() * like.element_size()].view(like.dtype).view(like.shape)


def _symmetric_bytes(ctx: ProgramContext, wl: Workload, shape: Shape) -> int:
    """Collective: the largest rank's output bytes (every rank's window gets that size)."""
    like = wl.make_output(shape, ctx.world_size, ctx.rank, torch.device("meta"))  # shape and dtype only
    most = torch.tensor([like.numel() * like.element_size()], dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=_harness_group())
    return int(most.item())


# -- one job on one judge ---------------------------------------------------------------------------
class _Job:
    """A job's shared state on one judge: its deadline, the judges' folder (abort flags), phases."""

    def __init__(self, ctx: ProgramContext, budget_s: float):
        self.ctx = ctx
        self.group = _harness_group()
        self.budget_s = budget_s
        self.deadline = time.monotonic() + budget_s
        folder = [tempfile.mkdtemp(prefix="cw_judge_") if ctx.rank == 0 else None]
        dist.broadcast_object_list(folder, src=0, group=self.group)
        self.dir = Path(folder[0])
        self.phases: dict[str, float] = {}
        self.programs: list[_Program] = []

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    def abort_flag(self, name: str, starting: bool = False) -> Callable[[], bool]:
        """Whether a peer gave up on program `name`; `starting`: only because it failed to start
        (what a rank still starting its own waits on: a fast peer's later verdict, e.g. unavailable,
        must not read as a failed start)."""
        path = self.dir / (f"abort-start-{name}" if starting else f"abort-{name}")
        return path.exists

    def abort(self, name: str, starting: bool = False) -> None:
        """Tell the peers' judges to stop waiting on program `name` (`starting`: it failed to start,
        so peers still starting theirs stop too)."""
        for flag in (f"abort-{name}", f"abort-start-{name}") if starting else (f"abort-{name}",):
            with contextlib.suppress(FileNotFoundError):  # rank 0 already removed the folder: the job is over
                (self.dir / flag).touch()

    def rendezvous(self, names: list[str]) -> dict[str, Path]:
        """A fresh folder per program, made by rank 0 and the same on every rank."""
        made = [{n: make_rendezvous() for n in names} if self.ctx.rank == 0 else None]
        dist.broadcast_object_list(made, src=0, group=self.group)
        return made[0]

    def start(self, programs: dict[str, str], label: str | None) -> dict[str, _Program]:
        """Program processes for `programs` (all forked first, so their startups overlap)."""
        began = time.perf_counter()
        places = self.rendezvous(list(programs))
        started: dict[str, _Program] = {}
        try:
            for name, text in programs.items():
                started[name] = _Program(self, name, text, places[name], label)
            for program in started.values():
                program.await_ready()
        except ProgramStartError:
            for name, program in started.items():
                self.abort(name, starting=True)
                program.close(blame=False)
            raise
        self.add("start", time.perf_counter() - began)
        self.add("init", max((p.proc.ready.get("init_s", 0.0) for p in started.values()), default=0.0))
        return started

    def close(self) -> None:
        """Kill whatever program processes are left (a job that raised), remove the judges' folder."""
        for program in self.programs:
            program.close(blame=False)
        self.programs.clear()  # each program points back at this job: the cycle would hold its buffers until a gc
        if self.ctx.rank == 0:
            shutil.rmtree(self.dir, ignore_errors=True)


class _Program:
    """One program on one rank: its process, buffers, events, and its verdict so far."""

    def __init__(self, job: _Job, name: str, text: str, rendezvous: Path, label: str | None):
        self.job, self.name, self.text, self.rendezvous = job, name, text, rendezvous
        self.ctx = job.ctx
        self.verdict = Verdict.passed()
        self.judged: Verdict | None = None  # the first wrong output of a timed iteration (it goes on being timed)
        self.shape, self.seed = label, None
        self.aborted = False
        self.peers_failed = False
        self.active = True
        self.buffers: SharedBuffers | None = None
        self.inputs: list[dict[str, torch.Tensor]] = []  # input set i: call i of a batch reads it
        self.outs: list[torch.Tensor] = []  # output i: call i of a batch writes it
        self.input_span: torch.Tensor | None = None  # every input set's bytes (uint8), one view
        self.set_stride = 0  # bytes from one input set to the next in input_span
        self.out_rows: torch.Tensor | None = None  # [sets, padded output]: every output, one view to poison
        self.staging: torch.Tensor | None = None  # GPUs: the judge's private copy of input_span, filled first
        self.staging_sets: list[dict[str, torch.Tensor]] = []
        self.go: Any = None
        self.done: Any = None
        self.proc = ProgramProcess.spawn(rank=self.ctx.rank, world_size=self.ctx.world_size,
                                         device=self.ctx.device.type, rendezvous=rendezvous, serve=SERVE,
                                         rules=confinement(self.ctx.device.type, SERVE))
        self.proc.stop_at_reply = not self.ctx.is_cuda
        job.programs.append(self)

    def await_ready(self) -> None:
        self.proc.await_ready(self.job.deadline, self.job.abort_flag(self.name, starting=True))

    # -- verdicts ---------------------------------------------------------------------------------
    @property
    def ok(self) -> bool:
        """Neither this rank nor, as far as the last agreement said, any other rank failed."""
        return self.verdict.ok and not self.aborted and not self.peers_failed

    def located(self, failure: FailureClass, what: str, detail: str = "") -> Verdict:
        """A failure verdict naming this rank and where the program is (shape, seed)."""
        return Verdict.failed(failure, what, rank=self.ctx.rank, shape=self.shape, seed=self.seed, detail=detail)

    def fail(self, failure: FailureClass, what: str, detail: str = "") -> None:
        """Record a failure here, unless an earlier one is already recorded; peers stop waiting."""
        if self.verdict.ok:
            self.verdict = self.located(failure, what, detail)
        self.job.abort(self.name)

    def agree(self) -> bool:
        """Collective: True on every rank iff no rank's program failed. A rank that only stopped
        because a peer gave up records that, should no peer have recorded why."""
        flags = torch.tensor([0 if self.verdict.ok else 1, int(self.aborted)], dtype=torch.int32)
        if self.ctx.world_size > 1:
            dist.all_reduce(flags, group=self.job.group)
        failed, aborted = int(flags[0]), int(flags[1])
        if aborted and not failed and self.verdict.ok:
            self.verdict = Verdict.failed(FailureClass.RUNTIME_ERROR, "a peer rank's program stopped answering",
                                          rank=self.ctx.rank, shape=self.shape, seed=self.seed)
        self.peers_failed = self.peers_failed or failed > 0 or aborted > 0
        return not self.peers_failed

    # -- requests ---------------------------------------------------------------------------------
    def call(self, what: str, op: str, *args: Any, then: Callable[[], None] | None = None,
             expect: tuple[type, ...] = (type(None),)) -> Any:
        """One request `op(*args)` whose answer must be of a type in `expect`; a failure becomes
        this rank's verdict and None is returned."""
        began = time.monotonic()
        reply = self.proc.request({"op": op, "args": list(args)}, self.job.deadline, self.job.abort_flag(self.name),
                                  then, expect)
        if reply.status == "ok":
            return reply.value
        if reply.status == "aborted":
            self.aborted = True
        elif reply.status == "invalid":
            self.fail(FailureClass.RUNTIME_ERROR, f"{what}: rank {self.ctx.rank}'s program process broke the "
                                                  f"judge's wire: {reply.message}")
        elif reply.status == "error":
            text = f"{what} raised {reply.error_type}: {reply.message}"
            if reply.error_type == WorkEscapedStream.__name__:
                self.fail(FailureClass.SUSPECT, f"{what}: {reply.message}", reply.traceback)
            else:
                sticky = is_sticky_cuda_error(text)
                self.fail(FailureClass.ILLEGAL_ADDRESS if sticky else FailureClass.RUNTIME_ERROR, text, reply.traceback)
        elif reply.status == "died":
            self.fail(FailureClass.RUNTIME_ERROR, f"{what}: rank {self.ctx.rank}'s program process died "
                                                  f"(exit code {reply.value})")
        else:
            waited = time.monotonic() - began
            self.fail(FailureClass.TIMEOUT, f"{what}: no answer within {waited:.1f} s, what was left of the job's "
                                            f"{self.job.budget_s:.0f} s (deadlock, endless loop, or too slow for the "
                                            "budget); its processes were killed")
        return None

    def harness(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Judge code (workload, checks): its failure is the harness's, never the program's doing."""
        try:
            return fn(*args)
        except WorkloadError:  # the workload cannot make this (an input it cannot lay out): the run's error
            raise
        except Exception as exc:
            located = Verdict.failed(FailureClass.RUNTIME_ERROR, f"{what} raised {type(exc).__name__}: {exc}",
                                     rank=self.ctx.rank, shape=self.shape, seed=self.seed).message
            raise HarnessError(located) from exc

    def load(self) -> None:
        reason = self.call("loading the program", "load", self.text, self.name, expect=(str, type(None)))
        if self.ok and reason:
            self.fail(FailureClass.UNAVAILABLE, reason)

    def setup(self, wl: Workload, shape: Shape, sets: list[dict[str, torch.Tensor]]) -> int | None:
        """setup() in the program process, then the judge's buffers shared with it: `sets` input
        sets laid out like the given tensors, then as many outputs (one per call of a batch), each
        view aligned. Returns the bytes setup holds."""
        symmetric = _symmetric_bytes(self.ctx, wl, shape) if wl.symmetric_output and self.ctx.is_cuda else 0
        held = self.call("setup()", "setup", shape.label, dict(shape.params), symmetric, expect=(int,))
        if not self.agree():
            return None
        like = wl.make_output(shape, self.ctx.world_size, self.ctx.rank, torch.device("meta"))
        specs = {f"in{i}.{k}": (tuple(v.shape), v.dtype) for i, inputs in enumerate(sets) for k, v in inputs.items()}
        specs.update({f"out{i}": (tuple(like.shape), like.dtype) for i in range(len(sets))})
        self.buffers = self.harness("sharing buffers", SharedBuffers, specs, self.ctx.device)
        self.inputs = [{k: self.buffers.tensors[f"in{i}.{k}"] for k in inputs} for i, inputs in enumerate(sets)]
        self.outs = [self.buffers.tensors[f"out{i}"] for i in range(len(sets))]
        keys = list(sets[0])
        self.input_span = self.buffers.span(f"in0.{keys[0]}", f"in{len(sets) - 1}.{keys[-1]}")
        self.set_stride = (self.inputs[1][keys[0]].data_ptr() - self.inputs[0][keys[0]].data_ptr() if len(sets) > 1
                           else self.input_span.numel())
        first = self.outs[0].data_ptr() - self.buffers.block.data_ptr()
        stride = self.outs[1].data_ptr() - self.outs[0].data_ptr() if len(sets) > 1 else self.buffers.nbytes - first
        self.out_rows = (self.buffers.block[first:first + len(sets) * stride].view(like.dtype)
                         .view(len(sets), stride // like.element_size()))
        if self.ctx.is_cuda:
            self.staging = torch.empty_like(self.input_span)
            self.staging_sets = [{k: self.staging[t.data_ptr() - self.input_span.data_ptr():][:t.numel() * t.element_size()]
                                  .view(t.dtype).view(t.shape) for k, t in inputs.items()} for inputs in self.inputs]
        handle = None
        if self.ctx.is_cuda:
            self.go = torch.cuda.Event(interprocess=True)
            handle = encode_bytes(self.go.ipc_handle())
        done = self.call("receiving the buffers", "buffers", handle, then=lambda: self.buffers.send(self.proc.conn),
                         expect=(str,) if self.ctx.is_cuda else (type(None),))
        if self.ok and self.ctx.is_cuda:
            try:
                self.done = torch.cuda.Event.from_ipc_handle(self.ctx.device, decode_bytes(done))
            except (WireError, RuntimeError) as exc:
                self.fail(FailureClass.RUNTIME_ERROR, f"its 'done' event handle cannot be opened: {exc}")
        return held

    def fill(self, index: int, values: dict[str, torch.Tensor], staged: bool = False) -> None:
        """Write `values` into input set `index` (the judge's shared buffers), or with `staged`
        into its private staging copy (GPUs: copied into the shared sets behind the timer's hold)."""
        for k, v in values.items():
            (self.staging_sets if staged else self.inputs)[index][k].copy_(v)

    def run(self) -> bool:
        """An untimed call on input set 0 into output 0 (poisoned first), the stream-order check
        included; True if it answered."""
        poison_(self.outs[0])
        if self.ctx.is_cuda:
            self.go.record()
        self.call("run()", "batch", 1, True)
        return self.ok

    def close(self, blame: bool = True) -> None:
        """Kill the program's processes; what escaped them, or a dead zygote, is tampering."""
        if self.proc.closed:
            return
        escaped = self.proc.close()
        zygote_alive = self.proc.zygote.alive
        if self.buffers is not None:  # the judge's views go first: the block is then freed as the buffers close
            self.inputs, self.outs, self.input_span, self.out_rows = [], [], None, None
            self.buffers.close()
        if self.ctx.rank == 0:
            remove_rendezvous(self.rendezvous)
        if blame and escaped:
            self.verdict = Verdict.passed()  # the evidence outranks whatever failed before
            self.fail(FailureClass.TAMPERING, f"{escaped} process(es) it started left its session or "
                                              "process tree to outlive it (killed)")
        if blame and not zygote_alive:
            self.verdict = Verdict.passed()
            self.fail(FailureClass.TAMPERING, "its parent (this rank's program zygote) was killed while it ran")


def _finish(program: _Program, teardown: bool) -> None:
    """teardown() where every rank may run it, then exit; the processes are killed either way."""
    if teardown and program.agree():
        program.call("teardown()", "teardown")
        program.agree()
    if program.ok:
        program.proc.request({"op": "exit", "args": []}, min(program.job.deadline, time.monotonic() + 5.0), lambda: False)
    program.close()


# -- correctness ----------------------------------------------------------------------------------
@dataclass
class RankCheck:
    """One rank's correctness check: its verdict, and where the judge's time went."""

    verdict: Verdict
    phases: dict[str, float] = field(default_factory=dict)


def check_program(ctx: ProgramContext, workload: str, text: str, name: str, shapes: list[Shape], seeds: list[int],
                  budget_s: float) -> RankCheck:
    """Every shape: setup once, then one run per seed on fresh inputs (consecutive runs on one
    state, so an output cached from an earlier call fails), each judged on every rank."""
    wl = resolve_workload(workload)
    job = _Job(ctx, budget_s)
    try:
        program = job.start({name: text}, None)[name]
        verdict = _check_started(wl, job, program, shapes, seeds)
        _finish(program, teardown=False)
    finally:
        job.close()
    return RankCheck(program.verdict if not program.verdict.ok else verdict, job.phases)


def _check_started(wl: Workload, job: _Job, program: _Program, shapes: list[Shape], seeds: list[int]) -> Verdict:
    """Load a started program and check it on every shape (see `check_program`): its verdict."""
    began = time.perf_counter()
    program.load()
    if program.agree():
        for shape in shapes:
            program.shape, program.seed = shape.label, None
            if not _check_shape(wl, program, shape, seeds):
                break
    job.add("checks", time.perf_counter() - began)
    if not program.verdict.ok:
        return program.verdict
    return Verdict.passed(f"{len(seeds)} seeds on {len(shapes)} shapes: {', '.join(s.label for s in shapes)}")


@dataclass
class RankEvaluation:
    """One rank's evaluation of a candidate in one job: its correctness verdict and, when it
    passed on every rank, the benchmark beside the baselines."""

    verdict: Verdict
    bench: RankBench | None
    phases: dict[str, float] = field(default_factory=dict)


def evaluate_program(ctx: ProgramContext, workload: str, name: str, text: str, baselines: dict[str, str],
                     check_shapes: list[Shape], seeds: list[int], shape: Shape, warmup: int, iters: int,
                     budget_s: float) -> RankEvaluation:
    """`check_program`'s checks of `text`, then `bench_programs`' benchmark of it beside
    `baselines` on `shape`, in one job: every program process starts once, all together (a start
    costs a CUDA context and a process group; the search pays it per candidate). The candidate's
    process serves both phases, as it serves every check shape in turn; the baselines' wait,
    unloaded, until it passed."""
    wl = resolve_workload(workload)
    job = _Job(ctx, budget_s)
    bench: RankBench | None = None
    try:
        started = job.start({name: text, **baselines}, None)
        verdict = _check_started(wl, job, started[name], check_shapes, seeds)
        if started[name].ok:
            bench = RankBench()
            _bench(job, wl, started, shape, warmup, iters, bench, loaded={name})
        else:
            for program in started.values():
                _finish(program, teardown=False)
            verdict = started[name].verdict if not started[name].verdict.ok else verdict  # what closing found
    finally:
        job.close()
    if bench is not None:
        bench.phases = job.phases
    return RankEvaluation(verdict, bench, job.phases)


def _check_shape(wl: Workload, program: _Program, shape: Shape, seeds: list[int]) -> bool:
    ctx = program.ctx
    first = program.harness("make_inputs()", wl.make_inputs, shape, ctx.world_size, ctx.rank, seeds[0], ctx.device)
    program.setup(wl, shape, [first])
    if not program.agree():
        return False
    for seed in seeds:
        program.seed = seed
        fresh = first if seed == seeds[0] else program.harness(
            "make_inputs()", wl.make_inputs, shape, ctx.world_size, ctx.rank, seed, ctx.device)
        program.fill(0, fresh)
        program.run()
        if program.agree():  # a rank whose run failed explains its peers' outputs: judge none then
            failure = _judge_run(wl, program, shape, seed, program.inputs[0], fresh, program.outs[0], "")
            if failure is not None:
                program.fail(failure.failure, failure.message)
        if not program.agree():
            return False
    program.seed = None
    program.call("teardown()", "teardown")  # a collective teardown stays matched: every rank set up
    return program.agree()


def _judge_run(wl: Workload, program: _Program, shape: Shape, seed: int, inputs: dict[str, torch.Tensor],
               pristine: dict[str, torch.Tensor], out: torch.Tensor, when: str) -> Verdict | None:
    """Inputs unchanged (where the workload's are read-only), then the output `out` against the
    reference of `seed` (all in the judge): the failure found, or None."""
    ctx = program.ctx
    changed = program.harness("comparing inputs", modified_inputs, inputs, pristine) if wl.inputs_read_only else []
    if changed:
        return program.located(FailureClass.WRONG_RESULT, f"{when}input {', '.join(map(repr, changed))} was modified")
    ref = program.harness("reference()", wl.reference, shape, ctx.world_size, ctx.rank, seed, ctx.device)
    untouched = program.harness("untouched()", wl.untouched, shape, ctx.world_size, ctx.rank, seed, ctx.device)
    verdict = program.harness("judging the output", judge_output, out, ref, wl.tolerance(), untouched)
    return None if verdict.ok else program.located(verdict.failure, f"{when}{verdict.message}")


# -- benchmark ------------------------------------------------------------------------------------
HOLD_S = 0.25  # GPUs: the longest the judge's stream waits for a batch to be queued behind its hold
#: a batch whose queueing took this share of HOLD_S or more may have started before it was queued
#: (a full launch queue blocks the program until the hold lets go): the warm-up halves K then
HOLD_EXPIRED = 0.8


@dataclass
class RankBench:
    """One rank's benchmark: per program, seconds per call of each timed batch, and a verdict."""

    input_sets: int = 0  # input sets (and outputs) each program had: the largest batch there was room for
    times: dict[str, list[float]] = field(default_factory=dict)
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)  # CUDA: bytes a program holds plus its peak in a call
    phases: dict[str, float] = field(default_factory=dict)
    verified: dict[str, int] = field(default_factory=dict)  # timed calls whose output was judged
    batch: dict[str, int] = field(default_factory=dict)  # calls per timed batch
    #: seconds a batch costs beyond its calls (the judge's resolution): a one-call batch's time
    #: minus the per-call time of full batches, from the probe
    crossing: dict[str, float] = field(default_factory=dict)
    #: seconds taken off every timed batch of every program: the smallest program's crossing
    subtracted: float = 0.0
    #: GPUs: timed batches a program had not finished queueing when the judge's hold let go
    expired: dict[str, int] = field(default_factory=dict)


def bench_programs(ctx: ProgramContext, workload: str, programs: dict[str, str], shape: Shape, warmup: int, iters: int,
                   budget_s: float) -> RankBench:
    """Time `programs` side by side on `shape`, each in program processes of its own: set each up
    once with room for a batch of calls (input sets and outputs, memory-bounded), probe it with
    one-call batches, size its batch to last `BATCH_TARGET_S` over `warmup` (at least 2) warm-up
    batches, then alternate `iters` timed batches between the programs. Every call of every batch
    runs on new random values the judge drew after setup, written into its set only once the
    program cannot run (on CPU stopped, on GPUs behind the timer's hold, then the L2 flushed); every
    output of a timed batch is checked for poison, and a random subset the program cannot predict
    is judged against the reference."""
    wl = resolve_workload(workload)
    job = _Job(ctx, budget_s)
    result = RankBench()
    try:
        _bench(job, wl, job.start(programs, shape.label), shape, warmup, iters, result)
    finally:
        job.close()
    result.phases = job.phases
    return result


@dataclass
class _Batch:
    """One batch as the judge ran it: seconds (judge's clock), and per call its seed and mask."""

    seconds: float
    seeds: list[int]
    untouched: list[torch.Tensor | None]
    unready: int  # outputs with poison (or non-finite values) left when the timer stopped
    expired: bool  # GPUs: the hold let go before the program had queued the batch (its CPU time shows)


def _bench(job: _Job, wl: Workload, started: dict[str, _Program], shape: Shape, warmup: int, iters: int,
           result: RankBench, loaded: frozenset[str] | set[str] = frozenset()) -> None:
    """The benchmark of started programs (those in `loaded` already loaded) into `result`."""
    ctx = job.ctx
    device = ctx.device.type
    began = time.perf_counter()
    for name, program in started.items():
        program.shape, program.seed = shape.label, None
        if name not in loaded:
            program.load()
        program.agree()
    probe = None
    first = next((p for p in started.values() if p.ok), None)
    if first is not None:
        probe = first.harness("make_inputs()", wl.make_inputs, shape, ctx.world_size, ctx.rank, 0, ctx.device)
    capacity = _batch_capacity(job, wl, shape, probe, len(started))
    result.input_sets = capacity
    seeds = _SeedStream(job)
    for name, program in started.items():
        if program.ok:
            held = program.setup(wl, shape, [probe] * capacity)
            if program.ok and held is not None:
                result.memory[name] = held
        program.agree()
    active = {name: p for name, p in started.items() if p.ok}
    if ctx.is_cuda:
        for name, program in active.items():
            program.fill(0, _draw(wl, program, shape, seeds.next(name))[0])
            program.go.record()
            peak = program.call("memory measurement", "memory", expect=(int,))
            if program.agree():
                result.memory[name] += peak
    else:
        result.memory.clear()  # host memory is not measured
    job.add("setup", time.perf_counter() - began)
    began = time.perf_counter()
    flush = _l2_flush_buffer(ctx)
    one_call: dict[str, list[float]] = {name: [] for name in active}
    for name, _ in interleaved_schedule(list(active), PROBE_BATCHES):
        batch = _run_batch(wl, active[name], shape, 1, seeds, flush)
        if batch is not None:
            one_call[name].append(batch.seconds)
    size = {name: _agreed_size(job, batch_size(min(t, default=0.0), capacity, device)) for name, t in one_call.items()}
    per_call: dict[str, float] = {}
    queueable = capacity  # GPUs: the most calls every program queued before the hold let go
    for name, _ in interleaved_schedule(list(active), max(warmup, 2)):
        if not active[name].active:
            continue
        batch = _run_batch(wl, active[name], shape, size[name], seeds, flush)
        if not active[name].active:  # turned off on every rank alike
            continue
        if batch is not None:
            per_call[name] = batch.seconds / size[name]
        if _any_rank(job, batch is not None and batch.expired):
            queueable = min(queueable, max(1, size[name] // 2))
        size[name] = _agreed_size(job, min(queueable, batch_size(per_call[name], capacity, device) if batch
                                           else size[name]))
    size = {name: _agreed_size(job, min(k, queueable))
            for name, k in common_sizes(size, per_call, capacity, device).items()}
    one_call = {name: [] for name in active}  # once warm: what a batch costs beyond its calls
    for name, _ in interleaved_schedule(list(active), PROBE_BATCHES):
        batch = _run_batch(wl, active[name], shape, 1, seeds, flush)
        if batch is not None:
            one_call[name].append(batch.seconds)
    crossing = _largest(job, {n: max(0.0, statistics.median(one_call[n]) - per_call[n])
                              if one_call[n] and n in per_call else 0.0 for n in active})
    result.subtracted = min(crossing.values(), default=0.0)
    job.add("warmup", time.perf_counter() - began)
    began = time.perf_counter()
    unready = {name: 0 for name in active}
    verifying = 0.0
    for name, i in interleaved_schedule(list(active), iters):
        program = active[name]
        batch = _run_batch(wl, program, shape, size[name], seeds, flush)
        if batch is None:
            continue
        result.times.setdefault(name, []).append(net_seconds(batch.seconds, result.subtracted) / size[name])
        result.expired[name] = result.expired.get(name, 0) + int(batch.expired)
        unready[name] += batch.unready
        t0 = time.perf_counter()
        picked = random.SystemRandom().sample(range(size[name]), min(VERIFY_PER_BATCH, size[name]))
        for call in picked if not batch.unready else []:
            program.seed = batch.seeds[call]
            pristine = ({} if not wl.inputs_read_only else program.staging_sets[call] if ctx.is_cuda
                        else _draw(wl, program, shape, batch.seeds[call])[0])
            failure = _judge_run(wl, program, shape, batch.seeds[call], program.inputs[call], pristine,
                                 program.outs[call], f"benchmark batch {i}, call {call}: ")
            program.judged = program.judged or failure
            program.seed = None
            result.verified[name] = result.verified.get(name, 0) + 1
        verifying += time.perf_counter() - t0
    job.add("timing", time.perf_counter() - began - verifying)
    job.add("checks", verifying)
    for name, program in started.items():
        timed = name in active and program.active and _still_ok(program)  # every rank timed every batch
        _finish(program, teardown=timed)
        if timed and program.verdict.ok and unready[name]:
            program.verdict = program.located(FailureClass.SUSPECT, f"output not ready at the end of the timed region "
                                                                    f"in {unready[name]} of {iters * size[name]} calls")
        if timed and program.verdict.ok and program.judged is not None:
            program.verdict = program.judged
        result.verdicts[name] = program.verdict
        if timed:
            result.batch[name], result.crossing[name] = size[name], crossing[name]
        else:
            result.times.pop(name, None)


def _run_batch(wl: Workload, program: _Program, shape: Shape, count: int, seeds: _SeedStream,
               flush: torch.Tensor | None) -> _Batch | None:
    """Collective: one batch of `count` calls on fresh values (a probe, warm-up or timed batch
    alike, so no program can tell them apart), or None when the program is out (then, or now)."""
    if not program.active or not _still_ok(program):
        return None
    ctx = program.ctx
    drawn = [seeds.next(program.name) for _ in range(count)]
    program.harness("prepare_inputs()", wl.prepare_inputs, shape, ctx.world_size, ctx.rank, drawn, ctx.device)
    masks = []
    for index, seed in enumerate(drawn):  # CPU: the program is stopped; GPUs: into the judge's private staging
        values, untouched = _draw(wl, program, shape, seed)
        program.fill(index, values, staged=ctx.is_cuda)
        masks.append(untouched)
    timed = _timed(program, count, masks, flush)
    if timed is None:
        return None
    return _Batch(timed[0], drawn, masks, timed[1], timed[2])


def _still_ok(program: _Program) -> bool:
    """Collective (lines the ranks up before a batch): False, and the program's processes killed
    on every rank, once any rank's run of it failed."""
    if program.agree():
        return True
    program.active = False
    program.close()
    return False


def _batch_capacity(job: _Job, wl: Workload, shape: Shape, probe: dict[str, torch.Tensor] | None, programs: int) -> int:
    """Calls a batch has room for, the same on every rank: a call's inputs (twice on GPUs: the
    judge's staging copy) and output within the memory budget of one program."""
    ctx = job.ctx
    device = ctx.device.type
    capacity = 1
    if probe is not None:
        like = wl.make_output(shape, ctx.world_size, ctx.rank, torch.device("meta"))
        inputs = sum(t.numel() * t.element_size() for t in probe.values())
        call = (2 * inputs if ctx.is_cuda else inputs) + like.numel() * like.element_size()
        budget = BATCH_BYTES[device]
        if ctx.is_cuda:
            budget = min(budget, int(BATCH_MEMORY_SHARE * torch.cuda.mem_get_info(ctx.device)[0] / max(1, programs)))
        capacity = batch_capacity(call, budget, device)
    count = torch.tensor([capacity])
    dist.all_reduce(count, op=dist.ReduceOp.MIN, group=job.group)
    return int(count.item())


def _agreed_size(job: _Job, size: int) -> int:
    """Collective: the smallest batch any rank proposes (every rank's program must make the same calls)."""
    if job.ctx.world_size == 1:
        return size
    smallest = torch.tensor([size], dtype=torch.int64)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=job.group)
    return int(smallest.item())


def _any_rank(job: _Job, flag: bool) -> bool:
    """Collective: whether `flag` holds on any rank."""
    if job.ctx.world_size == 1:
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=job.group)
    return bool(value.item())


def _largest(job: _Job, values: dict[str, float]) -> dict[str, float]:
    """Collective: per name, the largest value over ranks."""
    names = sorted(values)
    found = torch.tensor([values[n] for n in names], dtype=torch.float64)
    if job.ctx.world_size > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=job.group)
    return dict(zip(names, found.tolist()))


class _SeedStream:
    """Per program, an endless stream of input seeds: a keyed hash of a counter, the 128-bit key
    drawn by rank 0's judge from the OS's randomness after the programs started and shared with
    the other judges (so every rank draws the same seeds). No program sees a seed; each call,
    probe, warm-up or timed, gets one never used before."""

    def __init__(self, job: _Job):
        drawn = [secrets.token_bytes(16) if job.ctx.rank == 0 else None]
        dist.broadcast_object_list(drawn, src=0, group=job.group)
        self._key = drawn[0]
        self._count: dict[str, int] = {}

    def next(self, name: str) -> int:
        n = self._count.get(name, 0)
        self._count[name] = n + 1
        digest = hashlib.blake2b(f"{name}\0{n}".encode(), key=self._key, digest_size=5).digest()
        return int.from_bytes(digest, "big")


def _draw(wl: Workload, program: _Program, shape: Shape, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """This rank's inputs of `seed` and its untouched mask, in the judge's own memory."""
    ctx = program.ctx
    values = program.harness("make_inputs()", wl.make_inputs, shape, ctx.world_size, ctx.rank, seed, ctx.device)
    untouched = program.harness("untouched()", wl.untouched, shape, ctx.world_size, ctx.rank, seed, ctx.device)
    return values, untouched


def _l2_flush_buffer(ctx: ProgramContext) -> torch.Tensor | None:
    """GPUs: 2x L2 of scratch the judge zeroes before each timed batch, so inputs written just
    before it are not served from cache."""
    if not ctx.is_cuda:
        return None
    return torch.zeros(2 * H200.l2_bytes, dtype=torch.uint8, device=ctx.device)  # its kernel loaded outside a hold


def _unready(program: _Program, count: int, masks: list[torch.Tensor | None]) -> torch.Tensor:
    """How many of the first `count` outputs still hold poison (or non-finite values) where the
    program must write: a 0-dim tensor on the output's device (no sync)."""
    rows = program.out_rows[:count]  # padded rows: the padding is poison, never looked at
    if all(m is None for m in masks):
        return (poisoned_mask(rows) | ~torch.isfinite(rows))[:, :program.outs[0].numel()].any(dim=1).sum()
    return sum(not_ready(program.outs[i], masks[i]).int() for i in range(count))


def _timed(program: _Program, count: int, masks: list[torch.Tensor | None],
           flush: torch.Tensor | None) -> tuple[float, int, bool] | None:
    """One batch of `count` calls (input sets already written on CPU, staged on GPUs) timed by the
    judge: (seconds, outputs not ready when the timer stopped, whether the hold let go before the
    program had queued the batch), or None when it failed.
    CPU: wall time from the request to the moment the answer arrived (the program is stopped then,
    before anything is read). GPUs: CUDA events on the judge's stream, held until the batch is
    queued (`hold_stream`); behind the hold the judge copies the staged values into the sets,
    poisons the outputs and flushes L2, lines the GPUs up (device barrier), records its start event
    and the 'go' event the program's stream waits for; its end event waits for the program's
    'done' event, the outputs are checked for poison right after it, and then (untimed) the
    program's stream-order check runs."""
    ctx = program.ctx
    if not ctx.is_cuda:
        poison_(program.out_rows[:count])
        began = time.perf_counter()
        program.call("run()", "batch", count, False)
        if not program.ok:
            return None
        seconds = program.proc.replied_at - began
        return seconds, int(_unready(program, count, masks)), False
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    release = ctx.hold_stream(timeout_s=HOLD_S)
    span = min(program.set_stride * count, program.input_span.numel())
    program.input_span[:span].copy_(program.staging[:span])
    poison_(program.out_rows[:count])
    flush.zero_()
    if ctx.world_size > 1:
        ctx.device_barrier()
    start.record()
    program.go.record()
    asked = time.perf_counter()
    program.call("run()", "batch", count, False)
    expired = time.perf_counter() - asked >= HOLD_EXPIRED * HOLD_S
    if not program.ok:
        release()
        torch.cuda.synchronize(ctx.device)
        return None
    torch.cuda.current_stream(ctx.device).wait_event(program.done)
    end.record()
    release()
    unready = _unready(program, count, masks)
    torch.cuda.synchronize(ctx.device)
    seconds = start.elapsed_time(end) * 1e-3
    program.call("the stream-order check", "settle")
    if not program.ok:
        return None
    return seconds, int(unready), expired


# -- calibration ----------------------------------------------------------------------------------
def _best_seconds(ctx: ProgramContext, fn: Callable[[], Any], reps: int = 10, warmup: int = 3) -> float:
    """The fastest of `reps` runs (the machine's best rate gives the lowest, safest floor)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(reps):
        if ctx.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1e-3)
        else:
            began = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - began)
    return best


def _matmul_flops_per_s(ctx: ProgramContext) -> float:
    n = 8192 if ctx.is_cuda else 512
    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
    a, b = (torch.randn(n, n, device=ctx.device).to(dtype) for _ in range(2))
    c = torch.empty(n, n, device=ctx.device, dtype=dtype)
    return 2.0 * n**3 / _best_seconds(ctx, lambda: torch.mm(a, b, out=c))


def _copy_bytes_per_s(ctx: ProgramContext, src: torch.Tensor, dst: torch.Tensor, counted_bytes: int) -> float:
    return counted_bytes / _best_seconds(ctx, lambda: dst.copy_(src))


def calibrate_rates(ctx: ProgramContext) -> dict[str, float | None]:
    """matmul FLOP/s (bf16 cuBLAS on GPUs), HBM bytes/s (a device copy, reads + writes), and peer
    link bytes/s (rank 0 copies to the next GPU with `copy_`; on CPU, a gloo broadcast)."""
    group = _harness_group()
    nbytes = (1 << 30) if ctx.is_cuda else (64 << 20)
    matmul = _matmul_flops_per_s(ctx)
    src = torch.ones(nbytes, dtype=torch.uint8, device=ctx.device)
    hbm = _copy_bytes_per_s(ctx, src, torch.empty_like(src), 2 * nbytes)
    link: float | None = None
    dist.barrier(group=group)  # peers idle while the link is measured
    if ctx.world_size > 1:
        if ctx.is_cuda:
            if ctx.rank == 0:
                peer = torch.device("cuda", (ctx.device.index + 1) % torch.cuda.device_count())
                link = _copy_bytes_per_s(ctx, src, torch.empty_like(src, device=peer), nbytes)
        else:
            link = nbytes / _best_seconds(ctx, lambda: dist.broadcast(src, src=0, group=group))
    dist.barrier(group=group)
    return {"matmul": matmul, "hbm": hbm, "link": link}
