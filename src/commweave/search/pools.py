"""Evaluation pools: several candidates in flight at once, one per pool of W GPUs.

A pool is one judge (an `Evaluator` over a `WorkerPool` of W GPUs, or anything with the `Judge`
interface) that evaluates one candidate at a time. `LocalPools` runs its judges in this process,
one thread each; `commweave.search.ray_pools.RayPools` runs each as a Ray actor on a node of a
cluster. Either way the search submits a compiled program and gets a future of an `Outcome`: the
evaluation and the place (pool, node) that produced it, which the database records.

A pool that dies mid-candidate (its workers crashed, its actor or node was lost) is an
infrastructure failure, not the candidate's: the future fails with `PoolLost` and the search puts
the candidate back in the queue; only a program whose evaluations keep killing pools is charged.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from commweave.contracts.result import EvalResult, Judge
from commweave.contracts.workload import Shape


@dataclass(frozen=True)
class Placement:
    """Where an evaluation ran: the pool's label (its GPUs) and the node's name."""

    pool: str
    node: str


@dataclass
class Outcome:
    result: EvalResult
    placement: Placement


class PoolLost(RuntimeError):
    """The pool died while evaluating (an infrastructure failure); `placement` says which."""

    def __init__(self, message: str, placement: Placement):
        super().__init__(message)
        self.placement = placement


class Pools(Protocol):
    """What the search needs: how many candidates may be in flight, and a way to submit one."""

    @property
    def slots(self) -> int: ...

    def compile_source(self, source: str) -> object: ...

    def submit(self, text: str, shape: Shape) -> Future[Outcome]: ...

    def close(self) -> None: ...


#: exceptions of a local judge that mean its pool, not the candidate, failed
InfraErrors = tuple[type[BaseException], ...]


class LocalPools:
    """Judges in this process, each evaluating one candidate at a time on a thread of its own.

    `judges` pairs each judge with its placement. A judge raising one of `infrastructure_errors`
    (e.g. `PoolStartError`: its workers could not be restarted) fails that candidate's future with
    `PoolLost`; the judge is then rebuilt with `rebuild(index)` when given, else retired."""

    def __init__(self, judges: Sequence[tuple[Judge, Placement]], *, infrastructure_errors: InfraErrors = (),
                 rebuild: Callable[[int], Judge] | None = None):
        if not judges:
            raise ValueError("LocalPools needs at least one judge")
        self._judges: list[Judge | None] = [j for j, _ in judges]
        self._placements = [p for _, p in judges]
        self._infra = infrastructure_errors
        self._rebuild = rebuild
        self._free: list[int] = list(range(len(judges)))
        self._lock = threading.Condition()
        self._threads = ThreadPoolExecutor(max_workers=len(judges), thread_name_prefix="cw-pool")

    @classmethod
    def single(cls, judge: Judge) -> LocalPools:
        """One judge on this machine: the search's classic one-candidate-at-a-time mode."""
        return cls([(judge, Placement("pool0", socket.gethostname()))])

    @property
    def slots(self) -> int:
        return sum(j is not None for j in self._judges)

    def compile_source(self, source: str) -> object:
        judge = next(j for j in self._judges if j is not None)
        return judge.compile_source(source)

    def submit(self, text: str, shape: Shape) -> Future[Outcome]:
        return self._threads.submit(self._evaluate, text, shape)

    def _take(self) -> int:
        with self._lock:
            while not self._free:
                if self.slots == 0:
                    raise PoolLost("every pool has died", Placement("-", socket.gethostname()))
                self._lock.wait()
            return self._free.pop(0)

    def _evaluate(self, text: str, shape: Shape) -> Outcome:
        index = self._take()
        placement = self._placements[index]
        judge = self._judges[index]
        assert judge is not None
        try:
            result = judge.evaluate(text, shape)
        except self._infra as exc:
            replacement = self._replace(index)
            with self._lock:
                self._judges[index] = replacement
                if replacement is not None:
                    self._free.append(index)
                self._lock.notify_all()
            raise PoolLost(f"{placement.pool} on {placement.node} failed: {type(exc).__name__}: {exc}", placement) from exc
        with self._lock:
            self._free.append(index)
            self._lock.notify_all()
        return Outcome(result, placement)

    def _replace(self, index: int) -> Judge | None:
        if self._rebuild is None:
            return None
        try:
            return self._rebuild(index)
        except self._infra:
            return None

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)


def split_gpus(gpu_count: int, pool_gpus: int) -> list[list[int]]:
    """Device indices of each pool when a node's `gpu_count` GPUs are split into pools of
    `pool_gpus` (8 GPUs, W = 2: four pools); a remainder is left idle."""
    if pool_gpus < 1:
        raise ValueError(f"--pool-gpus must be at least 1, got {pool_gpus}")
    if pool_gpus > gpu_count:
        raise ValueError(f"--pool-gpus {pool_gpus} needs {pool_gpus} GPUs, this node has {gpu_count}")
    return [list(range(start, start + pool_gpus)) for start in range(0, gpu_count - pool_gpus + 1, pool_gpus)]
