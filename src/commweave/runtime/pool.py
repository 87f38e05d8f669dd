"""Worker pool: one persistent process per GPU, a job runs on every rank, a watchdog guards it.

Workers are started once and keep their NCCL communicator and windows across many jobs. A job is
a function `fn(ctx, **kwargs)` named by import path; it runs on all ranks at once (SPMD) and each
rank returns a picklable value. A hung job cannot be interrupted inside CUDA (a kernel spinning on
a flag nobody sets is the common distributed bug), so the watchdog kills the whole pool when the
job's time runs out, starts a fresh one, and reports `timeout`: the caller goes on.

Each pool has one folder (cw_pool_*): the rendezvous, and the workers' temp folder, where the judges
make job folders and candidates' private folders. The pool removes it whenever it kills its
workers (close, restart), so a judge killed mid-job leaves nothing behind; only a SIGKILL of the
pool's own process leaves the one folder.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from commweave.runtime.confine import apply_safe_env, die_with_parent, remove_tree

if TYPE_CHECKING:
    import torch

# Errors after which a CUDA context is unusable: the worker must die and be replaced.
STICKY_CUDA_ERRORS = (
    "illegal memory access", "illegal address", "misaligned address", "unspecified launch failure",
    "illegal instruction", "hardware stack error", "device-side assert", "CUDA_ERROR_ILLEGAL_ADDRESS",
    "CUDA_ERROR_LAUNCH_FAILED", "invalid program counter", "an illegal instruction",
)
ERROR_GRACE_S = 5.0  # after one rank fails, how long the others get to report before the pool is reset


def is_sticky_cuda_error(message: str) -> bool:
    low = message.lower()
    return any(s.lower() in low for s in STICKY_CUDA_ERRORS)


def is_out_of_memory(message: str) -> bool:
    """Whether an error message says a device (or host) allocation failed."""
    return "OutOfMemoryError" in message or "out of memory" in message.lower()


def host_oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has killed since boot (Linux's
    /proc/vmstat `oom_kill`), or None where that is not readable: a program process that died of
    SIGKILL while this rose was the host's memory running out, not a neighbour's doing."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


@dataclass
class RankFailure:
    """Why a rank's job did not return a value."""

    error_type: str  # exception class name, or 'timeout' / 'crashed'
    message: str
    traceback: str = ""

    @property
    def sticky(self) -> bool:
        return is_sticky_cuda_error(self.message)


@dataclass
class JobResult:
    status: Literal["ok", "error", "timeout"]
    values: list[Any]  # per rank; None where that rank failed or never answered
    failures: list[RankFailure | None]
    elapsed_s: float
    restarted: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def cause(self) -> tuple[int, RankFailure] | None:
        """(rank, failure) that explains the others: a dead worker (its peers then see 'connection
        closed'), else a sticky CUDA error, else the lowest rank that raised, else a silent rank."""

        def priority(failure: RankFailure) -> int:
            if failure.error_type == "crashed":
                return 0
            if failure.sticky:
                return 1
            return 3 if failure.error_type in ("timeout", "killed") else 2

        found = [(priority(f), r, f) for r, f in enumerate(self.failures) if f is not None]
        if not found:
            return None
        _, rank, failure = min(found, key=lambda item: item[:2])
        return rank, failure

    def first_failure(self) -> RankFailure | None:
        cause = self.cause()
        return cause[1] if cause else None


class PoolStartError(RuntimeError):
    """The workers could not be started (no GPUs, NCCL init failed, ...)."""


@dataclass
class _Job:
    job_id: int
    fn: str
    kwargs: dict[str, Any] = field(default_factory=dict)


def function_path(fn: str | Callable[..., Any]) -> str:
    """'package.module:function' for a module-level function (workers import it by name)."""
    if isinstance(fn, str):
        if ":" not in fn:
            raise ValueError(f"job function must be 'module:function', got {fn!r}")
        return fn
    module, qualname = fn.__module__, fn.__qualname__
    if "<locals>" in qualname or module == "__main__":
        raise ValueError(f"{qualname} must be a module-level function of an importable module")
    return f"{module}:{qualname}"


def resolve_function(path: str) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _build_context(rank: int, world_size: int, device_kind: str, init_file: str):
    """Start this worker's process group, then its context (RankContext.from_process_group)."""
    import torch
    import torch.distributed as dist

    from commweave.runtime.context import RankContext

    init = f"file://{init_file}"
    if device_kind == "cuda":
        if torch.cuda.device_count() < world_size:
            raise PoolStartError(f"{world_size} workers need {world_size} GPUs; this machine has {torch.cuda.device_count()}")
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=init, rank=rank, world_size=world_size, device_id=device)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    return RankContext.from_process_group(device)


IDLE_BYTES = 256 << 20  # GPUs: tensors a judge may keep between jobs (its flush buffer, RNG states) before a gc


def release_cached_memory(device: torch.device, collect: bool = True) -> None:
    """GPUs: give what finished work left in torch's caching allocator (a job's staging, blocks it
    shared with program processes, a failed allocation's neighbours) back to the device, so the
    next job, its program processes and anything else on the GPU can have it; a long-lived process
    otherwise keeps its largest job's memory for its whole life (PKB problems ran out of memory
    beside a judge holding 60 GB). Reference cycles are collected first when `collect` (a failed
    job's frames hold its tensors) or when tensors outlived the job (a cycle among its objects: a
    search's judge lost most of an H100's memory in 8 candidates that way, and its batches shrank to one call); a
    collection costs ~0.1 s, so not after every job on a search's hot path."""
    if device.type != "cuda":
        return
    import torch

    if collect or torch.cuda.memory_allocated(device) > IDLE_BYTES:
        gc.collect()
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()


def _worker_main(rank: int, world_size: int, device_kind: str, init_file: str, scratch: str, env: dict[str, str],
                 jobs: mp.Queue, results: mp.Queue) -> None:
    die_with_parent(parent=mp.parent_process().pid)  # a killed search takes its judges (and theirs) along
    tempfile.tempdir = scratch  # this judge's temporary folders, inside the pool's (removed with it)
    os.environ.update(env)
    apply_safe_env()
    try:
        ctx = _build_context(rank, world_size, device_kind, init_file)
    except BaseException as exc:  # report why, then die: the parent raises PoolStartError
        results.put(("init_failed", rank, RankFailure(type(exc).__name__, str(exc), traceback.format_exc())))
        results.close()
        results.join_thread()
        os._exit(2)
    results.put(("ready", rank, None))
    while True:
        job = jobs.get()
        if job is None:
            break
        failed = False
        try:
            value = resolve_function(job.fn)(ctx, **job.kwargs)
            results.put((job.job_id, rank, ("ok", value)))
        except BaseException as exc:
            failed = True
            failure = RankFailure(type(exc).__name__, str(exc), traceback.format_exc())
            results.put((job.job_id, rank, ("error", failure)))
            if failure.sticky:  # the CUDA context is gone: leave, the parent starts a new pool
                results.close()
                results.join_thread()
                os._exit(3)
        release_cached_memory(ctx.device, collect=failed)
    try:
        ctx.close()
        import torch.distributed as dist

        dist.destroy_process_group()
    finally:
        results.close()
        results.join_thread()


class WorkerPool:
    """`world_size` persistent workers (one per GPU, or CPU processes with gloo for tests)."""

    def __init__(self, world_size: int, device: Literal["cuda", "cpu"] = "cuda", job_timeout_s: float = 120.0,
                 start_timeout_s: float = 300.0, env: dict[str, str] | None = None):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
        self.world_size = world_size
        self.device = device
        self.job_timeout_s = job_timeout_s
        self.start_timeout_s = start_timeout_s
        self.env = dict(env or {})
        apply_safe_env(self.env)
        self.restarts = 0
        self._procs: list[mp.process.BaseProcess] = []
        self._job_queues: list[mp.Queue] = []
        self._results: mp.Queue | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._next_job = 0

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> WorkerPool:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is not None and issubclass(kind, KeyboardInterrupt):
            self._kill()  # interrupted: judges mid-job would finish it first (up to `close`'s 30 s)
        else:
            self.close()

    @property
    def running(self) -> bool:
        return bool(self._procs)

    def start(self) -> None:
        if self.running:
            return
        apply_safe_env()
        spawn = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory(prefix="cw_pool_")
        init_file = os.path.join(self._tmp.name, "rendezvous")
        scratch = os.path.join(self._tmp.name, "tmp")
        os.mkdir(scratch, 0o700)
        self._results = spawn.Queue()
        self._job_queues = [spawn.Queue() for _ in range(self.world_size)]
        self._procs = [
            spawn.Process(target=_worker_main, name=f"commweave-rank{r}", daemon=True,
                          args=(r, self.world_size, self.device, init_file, scratch, self.env, self._job_queues[r],
                                self._results))
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        ready: set[int] = set()
        deadline = time.monotonic() + self.start_timeout_s
        while len(ready) < self.world_size:
            try:
                tag, rank, failure = self._results.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in self._procs if p.exitcode is not None]
                if dead or time.monotonic() > deadline:
                    self._kill()
                    why = f"worker exited with code {dead[0].exitcode}" if dead else f"not ready after {self.start_timeout_s:.0f}s"
                    raise PoolStartError(f"worker pool failed to start: {why}") from None
                continue
            if tag == "init_failed":
                self._kill()
                raise PoolStartError(f"rank {rank} failed to start: {failure.error_type}: {failure.message}")
            ready.add(rank)

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=30)
        for q in [*self._job_queues, self._results]:
            if q is not None:
                q.cancel_join_thread()
                q.close()
        self._procs, self._job_queues, self._results = [], [], None
        if self._tmp is not None:
            # what killed judges and their candidates left, links never followed (remove_tree); a
            # program process still dying may write meanwhile, then the cleanup below retries
            with contextlib.suppress(OSError):
                remove_tree(Path(self._tmp.name))
            self._tmp.cleanup()
            self._tmp = None

    def restart(self) -> None:
        self._kill()
        self.restarts += 1
        self.start()

    def close(self) -> None:
        if not self.running:
            return
        for q in self._job_queues:
            q.put(None)
        deadline = time.monotonic() + 30
        for p in self._procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        self._kill()

    # -- jobs -----------------------------------------------------------------------------------
    def run(self, fn: str | Callable[..., Any], timeout_s: float | None = None, **kwargs: Any) -> JobResult:
        """Run `fn(ctx, **kwargs)` on every rank; never raises for the job's own failures."""
        self.start()
        assert self._results is not None
        job = _Job(self._next_job, function_path(fn), kwargs)
        self._next_job += 1
        for q in self._job_queues:
            q.put(job)
        began = time.monotonic()
        deadline = began + (timeout_s if timeout_s is not None else self.job_timeout_s)
        values: list[Any] = [None] * self.world_size
        failures: list[RankFailure | None] = [None] * self.world_size
        answered: set[int] = set()
        first_error_at: float | None = None
        while len(answered) < self.world_size:
            now = time.monotonic()
            limit = deadline if first_error_at is None else min(deadline, first_error_at + ERROR_GRACE_S)
            if now >= limit:
                break
            try:
                job_id, rank, (tag, payload) = self._results.get(timeout=min(0.25, limit - now))
            except queue.Empty:
                for r, p in enumerate(self._procs):
                    if r not in answered and p.exitcode is not None:
                        answered.add(r)
                        failures[r] = RankFailure("crashed", f"rank {r} worker died (exit code {p.exitcode})")
                        first_error_at = first_error_at or time.monotonic()
                continue
            if job_id != job.job_id:
                continue  # a late answer to an earlier job
            answered.add(rank)
            if tag == "ok":
                values[rank] = payload
            else:
                failures[rank] = payload
                first_error_at = first_error_at or time.monotonic()
        elapsed = time.monotonic() - began
        errored = any(f is not None for f in failures)
        for r in range(self.world_size):
            if r not in answered:
                reason = "still running when another rank failed" if errored else f"no answer within {deadline - began:.1f}s"
                failures[r] = RankFailure("timeout" if not errored else "killed", f"rank {r}: {reason}")
        if not errored and len(answered) == self.world_size:
            return JobResult("ok", values, failures, elapsed)
        # A rank that hung, died or hit a sticky CUDA error leaves the pool unusable: replace it.
        must_restart = len(answered) < self.world_size or any(f is not None and (f.sticky or f.error_type == "crashed") for f in failures)
        if must_restart:
            self.restart()
        status: Literal["error", "timeout"] = "error" if errored else "timeout"
        return JobResult(status, values, failures, elapsed, restarted=must_restart)
