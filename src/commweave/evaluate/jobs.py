"""Worker-side jobs of the cascade: correctness check, side-by-side benchmark, rate calibration.

Each job runs on every rank (`WorkerPool.run`). Ranks stay in lockstep: after every step that ran
candidate code, all ranks agree over a private gloo group whether any rank failed, and branch only
on that agreement, so a failing rank never leaves its peers waiting in a collective (which would
cost a pool restart) and collective setup/teardown calls stay matched. A candidate's ordinary
exception becomes its rank's verdict; a sticky CUDA error is re-raised, because the worker's CUDA
context is gone and the pool must replace it.

Outputs come from `harness_output`: a symmetric window for workloads that ask for one
(`Workload.symmetric_output`), so device programs may store into peers' outputs.

Workloads travel to workers as 'module:Class' paths (`workload_ref`): the class must be importable
there (the pool's PYTHONPATH) and constructible without arguments.
"""

from __future__ import annotations

import functools
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from commweave.contracts.context import ProgramContext
from commweave.contracts.poison import poison_
from commweave.evaluate.checks import judge_output, modified_inputs, not_ready
from commweave.contracts.program import load_program, unavailable_reason
from commweave.evaluate.timing import input_sets_for, interleaved_schedule
from commweave.runtime.timers import gated_seconds
from commweave.contracts.verdict import FailureClass, HarnessError, Verdict, WorkloadError
from commweave.runtime.pool import is_sticky_cuda_error, resolve_function
from commweave.contracts.workload import Shape, Workload

_GROUP: Any = None  # this worker's harness group, created by the first job every rank runs


class StickyCudaError(RuntimeError):
    """Candidate code broke the CUDA context; raised so that the pool replaces this worker."""


def _harness_group() -> Any:
    """A gloo group of our own: candidates' collectives (even on ctx.cpu_group) cannot mix with
    the harness's agreements. Every job calls this first, so all ranks create it together."""
    global _GROUP
    if _GROUP is None:
        _GROUP = dist.new_group(backend="gloo")
    return _GROUP


def workload_ref(workload: Workload) -> str:
    """'module:Class' by which workers rebuild `workload`."""
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


class _Steps:
    """One rank's progress through a program: where it is, and its first failure."""

    def __init__(self, rank: int, shape: str | None = None):
        self.rank = rank
        self.shape = shape
        self.seed: int | None = None
        self.verdict = Verdict.passed()

    @property
    def ok(self) -> bool:
        return self.verdict.ok

    def fail(self, failure: FailureClass, what: str, detail: str = "") -> None:
        """Record a failure here, unless an earlier one is already recorded."""
        if self.verdict.ok:
            self.verdict = Verdict.failed(failure, what, rank=self.rank, shape=self.shape, seed=self.seed, detail=detail)

    def _located(self, text: str) -> str:
        return Verdict.failed(FailureClass.RUNTIME_ERROR, text, rank=self.rank, shape=self.shape, seed=self.seed).message

    def attempt(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run candidate code; an exception becomes a runtime_error here (None is returned), a
        sticky CUDA error propagates."""
        try:
            return fn(*args)
        except Exception as exc:
            text = f"{what} raised {type(exc).__name__}: {exc}"
            if is_sticky_cuda_error(text):
                raise StickyCudaError(self._located(text)) from exc
            self.fail(FailureClass.RUNTIME_ERROR, text, traceback.format_exc())
            return None

    def harness(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run harness code (workload, checks): its failure is the harness's, not the candidate's,
        except for a sticky CUDA error, which only a candidate's kernel can have caused."""
        try:
            return fn(*args)
        except Exception as exc:
            text = f"{what} raised {type(exc).__name__}: {exc}"
            if is_sticky_cuda_error(text):
                raise StickyCudaError(self._located(text)) from exc
            raise HarnessError(self._located(text)) from exc

    def agree(self) -> bool:
        """Collective: True on every rank iff every rank's verdict still passes."""
        flag = torch.tensor([0 if self.verdict.ok else 1], dtype=torch.int32)
        dist.all_reduce(flag, group=_harness_group())
        return int(flag.item()) == 0


def _load(ctx: ProgramContext, steps: _Steps, text: str, name: str) -> Any:
    """Load a program and ask whether it can run here; all ranks agree on the outcome."""
    program = steps.attempt("loading the program", load_program, text, name)
    if steps.agree():
        reason = steps.attempt("available()", unavailable_reason, program, ctx)
        if reason:
            steps.fail(FailureClass.UNAVAILABLE, reason)
    return program


def _teardown(ctx: ProgramContext, steps: _Steps, program: Any, state: Any) -> None:
    teardown = getattr(program, "teardown", None)
    if teardown is not None:
        steps.attempt("teardown()", teardown, ctx, state)


# -- correctness ----------------------------------------------------------------------------------
def check_program(ctx: ProgramContext, workload: str, text: str, name: str, shapes: list[Shape], seeds: list[int]) -> Verdict:
    """Every shape: setup once, then one run per seed on fresh inputs (consecutive runs on one
    state, so an output cached from an earlier call fails), each judged on every rank."""
    _harness_group()
    wl = resolve_workload(workload)
    steps = _Steps(ctx.rank)
    program = _load(ctx, steps, text, name)
    if not steps.agree():
        return steps.verdict
    for shape in shapes:
        steps.shape, steps.seed = shape.label, None
        if not _check_shape(ctx, wl, program, steps, shape, seeds):
            return steps.verdict
    return Verdict.passed(f"{len(seeds)} seeds on {len(shapes)} shapes: {', '.join(s.label for s in shapes)}")


def _check_shape(ctx: ProgramContext, wl: Workload, program: Any, steps: _Steps, shape: Shape, seeds: list[int]) -> bool:
    state = steps.attempt("setup()", program.setup, ctx, shape)
    set_up = steps.agree()
    if set_up:
        for seed in seeds:
            steps.seed = seed
            _check_seed(ctx, wl, program, state, steps, shape, seed)
            if not steps.agree():
                break
        steps.seed = None
        _teardown(ctx, steps, program, state)  # collective teardowns stay matched: all ranks set up
    steps.attempt("end_candidate()", ctx.end_candidate)
    return steps.agree()


def harness_output(ctx: ProgramContext, wl: Workload, shape: Shape) -> torch.Tensor:
    """This rank's output buffer as the harness makes it, for checks, benchmarks and tests alike.

    With `wl.symmetric_output` on a CUDA pool it lies in a symmetric window (`ctx.symmetric`), so a
    device program can store straight into its peers' outputs; this is collective (every rank calls
    it, in the same order), and every rank takes the largest rank's byte count so the windows match.
    The window returns to the context's free list at `ctx.end_candidate()`. Otherwise (CPU pools,
    other workloads) it is `make_output`'s tensor."""
    if not (wl.symmetric_output and ctx.is_cuda):
        return wl.make_output(shape, ctx.world_size, ctx.rank, ctx.device)
    like = wl.make_output(shape, ctx.world_size, ctx.rank, torch.device("meta"))  # shape and dtype only
    nbytes = like.numel() * like.element_size()
    most = torch.tensor([nbytes], dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=_harness_group())
    storage = ctx.symmetric((int(most.item()),), torch.uint8, zero=False)
    return storage[:nbytes].view(like.dtype).view(like.shape)


def _fresh_case(wl: Workload, shape: Shape, ctx: ProgramContext, seed: int) -> tuple[dict, dict, torch.Tensor]:
    inputs = wl.make_inputs(shape, ctx.world_size, ctx.rank, seed, ctx.device)
    pristine = {k: v.clone() for k, v in inputs.items()}
    out = poison_(harness_output(ctx, wl, shape))
    return inputs, pristine, out


def _run_synchronized(ctx: ProgramContext, program: Any, state: Any, inputs: dict, out: torch.Tensor) -> None:
    """A run, then a device-wide sync: the run's work on every stream counts as its own."""
    program.run(ctx, state, dict(inputs), out)
    ctx.synchronize()


def _check_seed(ctx: ProgramContext, wl: Workload, program: Any, state: Any, steps: _Steps, shape: Shape, seed: int) -> None:
    inputs, pristine, out = steps.harness("make_inputs()/make_output()", _fresh_case, wl, shape, ctx, seed)
    steps.attempt("run()", _run_synchronized, ctx, program, state, inputs, out)
    if not steps.ok:
        return
    changed = modified_inputs(inputs, pristine)
    if changed:
        steps.fail(FailureClass.WRONG_RESULT, f"input {', '.join(map(repr, changed))} was modified")
        return
    ref = steps.harness("reference()", wl.reference, shape, ctx.world_size, ctx.rank, seed, ctx.device)
    untouched = steps.harness("untouched()", wl.untouched, shape, ctx.world_size, ctx.rank, seed, ctx.device)
    verdict = steps.harness("judging the output", judge_output, out, ref, wl.tolerance(), untouched)
    if not verdict.ok:
        steps.fail(verdict.failure, verdict.message)


# -- benchmark ------------------------------------------------------------------------------------
@dataclass
class RankBench:
    """One rank's benchmark: seconds per timed iteration, and a verdict, per program."""

    input_sets: int = 0
    times: dict[str, list[float]] = field(default_factory=dict)
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)  # CUDA: bytes a program holds plus its peak in a call


def _timed_iteration(ctx: ProgramContext, program: Any, state: Any, inputs: dict, out: torch.Tensor,
                     untouched: torch.Tensor | None) -> tuple[float, bool]:
    """(seconds, output ready at the end of the timed region). Poisoning happens before the timed
    region; all ranks start it together (a device-side barrier on GPUs). On GPUs the stream is held
    until the call is queued (`timing.gated_seconds`), so the timer measures the GPUs' time, not
    the host's launch time: what a call costs inside a model whose host runs ahead of its GPUs."""
    poison_(out)
    if ctx.is_cuda:
        seconds, unready = gated_seconds(ctx, lambda: program.run(ctx, state, dict(inputs), out),
                                         lambda: not_ready(out, untouched))  # the output as the timer saw it
        return seconds, not bool(unready)
    dist.barrier(group=_harness_group())
    began = time.perf_counter()
    program.run(ctx, state, dict(inputs), out)
    seconds = time.perf_counter() - began
    return seconds, not bool(not_ready(out, untouched))


def _held_bytes(ctx: ProgramContext) -> int:
    """Device memory held right now: torch's allocated tensors and the symmetric windows in use."""
    if not ctx.is_cuda:
        return 0
    return torch.cuda.memory_allocated(ctx.device) + ctx.symmetric_bytes_in_use()


def _call_peak_bytes(ctx: ProgramContext, name: str, program: Any, state: Any, inputs: dict, out: torch.Tensor) -> int:
    """What two calls of a set-up program add at their peak and keep (workspaces, graph pools):
    counted once per program, before the interleaved warm-up, every rank in the same order."""
    torch.cuda.synchronize(ctx.device)
    before = _held_bytes(ctx)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    try:  # run() alone: the harness's own checks would add their temporaries to the peak
        for _ in range(2):  # eager first call, then a capture or replay where the program keeps graphs
            program.run(ctx, state, dict(inputs), out)
        torch.cuda.synchronize(ctx.device)
    except Exception as exc:
        raise _run_failure(ctx, name, "memory measurement call", exc) from exc
    peak = torch.cuda.max_memory_allocated(ctx.device) + ctx.symmetric_bytes_in_use()
    return max(peak - before, _held_bytes(ctx) - before, 0)


def bench_programs(ctx: ProgramContext, workload: str, programs: dict[str, str], shape: Shape, warmup: int, iters: int,
                   seed: int) -> RankBench:
    """Time `programs` side by side on `shape`: set each up once, rotate input sets (past 2x L2),
    warm up on every input set (at least `warmup` iterations: a program that caches per input
    address, e.g. a CUDA graph per address set, is timed in its steady state, not while capturing),
    interleave iterations round-robin, and judge each program's last output."""
    _harness_group()
    wl = resolve_workload(workload)
    result = RankBench()
    active: dict[str, tuple[Any, Any]] = {}
    for name, text in programs.items():
        steps = _Steps(ctx.rank, shape.label)
        program = _load(ctx, steps, text, name)
        if steps.agree():
            held = _held_bytes(ctx)
            state = steps.attempt("setup()", program.setup, ctx, shape)
            if steps.agree():
                active[name] = (program, state)
                result.memory[name] = _held_bytes(ctx) - held
        result.verdicts[name] = steps.verdict
    steps = _Steps(ctx.rank, shape.label)
    if active:
        sets = _input_sets(ctx, wl, shape, seed, steps)
        result.input_sets = len(sets)
        untouched = {set_seed: steps.harness("untouched()", wl.untouched, shape, ctx.world_size, ctx.rank, set_seed,
                                             ctx.device) for set_seed, _ in sets}
        outs = {name: steps.harness("make_output()", harness_output, ctx, wl, shape) for name in active}
        if ctx.is_cuda:
            for name, (program, state) in active.items():
                result.memory[name] += _call_peak_bytes(ctx, name, program, state, sets[0][1], outs[name])
        else:
            result.memory.clear()  # host memory is not measured
        for name, i in interleaved_schedule(list(active), max(warmup, len(sets))):
            program, state = active[name]
            set_seed, inputs = sets[i % len(sets)]
            _iteration(ctx, name, i, program, state, inputs, outs[name], untouched[set_seed])
        unready = {name: 0 for name in active}
        for name, i in interleaved_schedule(list(active), iters):
            program, state = active[name]
            set_seed, inputs = sets[i % len(sets)]
            seconds, ready = _iteration(ctx, name, i, program, state, inputs, outs[name], untouched[set_seed])
            result.times.setdefault(name, []).append(seconds)
            unready[name] += not ready
        last_seed = sets[(iters - 1) % len(sets)][0]
        ref = steps.harness("reference()", wl.reference, shape, ctx.world_size, ctx.rank, last_seed, ctx.device)
        for name in active:
            result.verdicts[name] = _bench_verdict(ctx, wl, name, shape, outs[name], ref, untouched[last_seed],
                                                   last_seed, unready[name], iters)
        for name, (program, state) in active.items():
            teardown = _Steps(ctx.rank, shape.label)
            _teardown(ctx, teardown, program, state)
            if result.verdicts[name].ok:
                result.verdicts[name] = teardown.verdict
    steps.harness("end_candidate()", ctx.end_candidate)
    return result


def _input_sets(ctx: ProgramContext, wl: Workload, shape: Shape, seed: int, steps: _Steps) -> list[tuple[int, dict]]:
    """(seed, inputs) pairs; every rank uses the same count, so set i has the same seed everywhere."""
    first = steps.harness("make_inputs()", wl.make_inputs, shape, ctx.world_size, ctx.rank, seed, ctx.device)
    count = torch.tensor([input_sets_for(sum(t.numel() * t.element_size() for t in first.values()))])
    dist.all_reduce(count, op=dist.ReduceOp.MIN, group=_harness_group())
    sets = [(seed, first)]
    for i in range(1, int(count.item())):
        sets.append((seed + i, steps.harness("make_inputs()", wl.make_inputs, shape, ctx.world_size, ctx.rank,
                                              seed + i, ctx.device)))
    return sets


def _iteration(ctx: ProgramContext, name: str, i: int, program: Any, state: Any, inputs: dict, out: torch.Tensor,
               untouched: torch.Tensor | None) -> tuple[float, bool]:
    """One timed run; any exception aborts the job, named after the program (peers cannot be
    released from the barrier they wait in, so the pool restarts)."""
    try:
        return _timed_iteration(ctx, program, state, inputs, out, untouched)
    except Exception as exc:
        raise _run_failure(ctx, name, f"benchmark iteration {i}", exc) from exc


def _run_failure(ctx: ProgramContext, name: str, when: str, exc: Exception) -> Exception:
    """The error that aborts a benchmark job when a program's run() raised."""
    text = f"program {name!r}, {when}: run() raised {type(exc).__name__}: {exc} (rank {ctx.rank})"
    return StickyCudaError(text) if is_sticky_cuda_error(text) else RuntimeError(text)


def _bench_verdict(ctx: ProgramContext, wl: Workload, name: str, shape: Shape, out: torch.Tensor, ref: torch.Tensor,
                   untouched: torch.Tensor | None, seed: int, unready: int, iters: int) -> Verdict:
    steps = _Steps(ctx.rank, shape.label)
    if unready:
        steps.fail(FailureClass.SUSPECT, f"output not ready at the end of the timed region in {unready} of {iters} iterations")
        return steps.verdict
    steps.seed = seed
    verdict = steps.harness("judging the output", judge_output, out, ref, wl.tolerance(), untouched)
    if not verdict.ok:
        steps.fail(verdict.failure, f"benchmark's last iteration: {verdict.message}")
    return steps.verdict


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
