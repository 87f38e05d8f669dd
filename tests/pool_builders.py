"""Judges that Ray actors build on their node (by "module:function"), for tests/test_search_ray.py
and bench/search_throughput.py: a simulated one with a known evaluation time, and the real
Evaluator over CPU gloo workers with the toy workload (optionally held to a known time)."""

from __future__ import annotations

import time

from commweave.evaluate import Evaluator
from commweave.runtime import WorkerPool
from commweave.search.simulate import SimulatedEvaluator
from commweave.workloads import get_workload
from toy_workload import ToyGatherMatmul


def simulated(delay_s: float, seed: int = 0) -> SimulatedEvaluator:
    """gemm-allgather's simulated landscape; every evaluation takes `delay_s` (a GPU's time)."""
    template = get_workload("gemm-allgather").template()
    return SimulatedEvaluator(template, 4, template.seed_directives().with_(comm_ctas=16), delay_s=delay_s, seed=seed)


class HeldJudge:
    """A judge whose every evaluation takes at least `eval_s`: the real cascade, then the rest of
    the time idle, as a pool is while its GPUs run a candidate (the toy's CPU work is tiny)."""

    def __init__(self, judge: Evaluator, eval_s: float):
        self.judge, self.eval_s = judge, eval_s

    @property
    def pool(self) -> WorkerPool:
        return self.judge.pool

    def compile_source(self, source: str) -> object:
        return self.judge.compile_source(source)

    def evaluate(self, text, shape):
        start = time.monotonic()
        result = self.judge.evaluate(text, shape)
        time.sleep(max(0.0, self.eval_s - (time.monotonic() - start)))
        return result


def toy_cpu(world: int, eval_s: float = 0.0) -> Evaluator | HeldJudge:
    """The real cascade on `world` CPU gloo workers, started now and kept for the actor's life;
    with `eval_s`, each evaluation held to that long."""
    pool = WorkerPool(world, device="cpu", job_timeout_s=120)
    pool.start()
    judge = Evaluator(pool, ToyGatherMatmul(), warmup=1, iters=3, seeds=2)
    return HeldJudge(judge, eval_s) if eval_s else judge
