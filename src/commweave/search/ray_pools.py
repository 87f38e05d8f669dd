"""Evaluation pools as Ray actors: each holds W GPUs of one node and a judge built there.

Ray (the optional extra `commweave[cluster]`) places the actors, restarts nothing by itself and
reports an actor or node that died; this module turns that into `PoolLost` (the search re-queues
the candidate) and starts a replacement actor. The actors are owned by the search process, so
Ray ends them when it dies. Compiled cubins travel with each job (`runtime.compile.artifact_files`)
and are installed into the node's own cache before the evaluation: no node-local state is assumed.
The database stays with the search process: an actor only returns results.
"""

from __future__ import annotations

import socket
import threading
from concurrent.futures import Future
from typing import Any

from commweave.contracts.program import parse_program
from commweave.contracts.workload import Shape
from commweave.runtime.compile import artifact_files, compile_cubin
from commweave.search.pools import Outcome, Placement, PoolLost

INSTALL_HINT = "pip install 'commweave[cluster]'"


def import_ray() -> Any:
    """The `ray` module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(f"--cluster needs Ray, which is not installed: {INSTALL_HINT}") from exc
    return ray


class _PoolActor:
    """One pool: builds its judge with `build(**kwargs)` on its node, evaluates one program at a time."""

    def __init__(self, build: str, kwargs: dict[str, Any]):
        from commweave.runtime.pool import resolve_function

        self.judge = resolve_function(build)(**kwargs)

    def ready(self) -> bool:
        return True

    def close(self) -> None:
        """Close the judge's pool (its worker processes and temporary folder), where it has one."""
        pool = getattr(self.judge, "pool", None)
        if pool is not None:
            pool.close()

    def evaluate(self, text: str, shape: Shape, artifacts: dict[str, bytes]) -> tuple[Any, str]:
        """(the judge's result, this node's name)."""
        import ray

        from commweave.runtime.compile import install_artifacts

        install_artifacts(artifacts)
        node = f"{socket.gethostname()}/{ray.get_runtime_context().get_node_id()[:8]}"
        return self.judge.evaluate(text, shape), node


class RayPools:
    """`count` pools, each a Ray actor with `gpus_per_pool` GPUs (and `cpus_per_pool` CPUs) whose
    judge is `build(**kwargs)` ("module:function", importable on every node; a judge with a `pool`
    has it closed with the actor), spread over the cluster's nodes. A lost pool is replaced; a
    replacement the cluster cannot place within `placement_timeout_s` (its node's capacity is
    gone) retires the slot."""

    def __init__(self, build: str, kwargs: dict[str, Any], count: int, *, gpus_per_pool: int = 0,
                 cpus_per_pool: float = 1.0, address: str | None = None, placement_timeout_s: float = 60.0):
        if count < 1:
            raise ValueError(f"need at least one pool, got {count}")
        self.ray = import_ray()
        if not self.ray.is_initialized():
            self.ray.init(address=address, log_to_driver=False, configure_logging=False)
        self._actor_class = self.ray.remote(num_gpus=gpus_per_pool, num_cpus=cpus_per_pool, max_restarts=0,
                                            scheduling_strategy="SPREAD")(_PoolActor)
        self._build, self._kwargs = build, kwargs
        self.placement_timeout_s = placement_timeout_s
        self._lock = threading.Condition()
        self._actors: list[Any | None] = [self._start() for _ in range(count)]  # None: a retired slot
        self._nodes = ["(not placed yet)"] * count  # each pool's node as its last result said
        self.restarts = 0
        # every pool built (its judge's workers started) before the search counts time
        refs = [actor.ready.remote() for actor in self._actors]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=placement_timeout_s)
        if len(ready) < len(refs):
            self.close()
            raise RuntimeError(f"the Ray cluster placed {len(ready)} of {count} pools within {placement_timeout_s:.0f} s "
                               f"(each needs {gpus_per_pool} GPUs and {cpus_per_pool} CPUs)")
        self.ray.get(ready)  # a judge that failed to build raises here
        self._free = list(range(count))

    def _start(self) -> Any:
        return self._actor_class.remote(self._build, self._kwargs)

    @property
    def slots(self) -> int:
        return sum(a is not None for a in self._actors)

    def compile_source(self, source: str) -> object:
        return compile_cubin(source)

    def submit(self, text: str, shape: Shape) -> Future[Outcome]:
        artifacts = artifact_files(parse_program(text).cuda_sources)
        with self._lock:
            while not self._free:
                if self.slots == 0:
                    raise PoolLost("every pool is lost and none could be placed again", Placement("-", "-"))
                self._lock.wait()
            index = self._free.pop(0)
        placement = Placement(f"pool{index}", self._nodes[index])
        ref = self._actors[index].evaluate.remote(text, shape, artifacts)
        outcome: Future[Outcome] = Future()
        ref.future().add_done_callback(lambda done: self._settle(index, placement, done, outcome))
        return outcome

    def _settle(self, index: int, placement: Placement, done: Future, outcome: Future[Outcome]) -> None:
        lost = (self.ray.exceptions.RayActorError, self.ray.exceptions.WorkerCrashedError,
                self.ray.exceptions.NodeDiedError, self.ray.exceptions.ActorUnavailableError)
        try:
            result = done.result()
        except lost as exc:
            self._replace(index)
            outcome.set_exception(PoolLost(f"{placement.pool} on {placement.node} was lost: {type(exc).__name__}",
                                           placement))
            return
        except self.ray.exceptions.RayTaskError as exc:
            self._release(index)
            outcome.set_exception(exc.as_instanceof_cause())
            return
        evaluation, node = result
        self._nodes[index] = node
        self._release(index)
        outcome.set_result(Outcome(evaluation, Placement(placement.pool, node)))

    def _release(self, index: int) -> None:
        with self._lock:
            self._free.append(index)
            self._lock.notify_all()

    def _replace(self, index: int) -> None:
        """A new actor in the dead one's slot, free once Ray has placed it; retired if it cannot be."""
        actor = self._start()
        with self._lock:
            self._actors[index] = actor
            self.restarts += 1
        threading.Thread(target=self._await_placement, args=(index, actor), daemon=True).start()

    def _await_placement(self, index: int, actor: Any) -> None:
        ready, _ = self.ray.wait([actor.ready.remote()], timeout=self.placement_timeout_s)
        with self._lock:
            if ready:
                self._free.append(index)
            else:
                self.ray.kill(actor, no_restart=True)
                self._actors[index] = None
            self._lock.notify_all()

    def kill(self, index: int) -> None:
        """End one pool's actor (what a lost node does to it); its candidate comes back as PoolLost."""
        self.ray.kill(self._actors[index], no_restart=True)

    def close(self, wait_s: float = 30.0) -> None:
        """Ask every pool to close its judge's pool (workers, temporary folder), then end the actors;
        one that has not closed within `wait_s` (a lost node's) is ended all the same."""
        actors = [actor for actor in self._actors if actor is not None]
        refs = [actor.close.remote() for actor in actors]
        self.ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        for actor in actors:
            self.ray.kill(actor, no_restart=True)
