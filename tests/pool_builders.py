"""Judges that Ray actors build on their node (by "module:function"), for tests/test_search_ray.py
and bench/search_throughput.py: a simulated one with a known evaluation time, and the real
Evaluator over CPU gloo workers with the toy workload."""

from __future__ import annotations

from commweave.evaluate import Evaluator
from commweave.runtime import WorkerPool
from commweave.search.simulate import SimulatedEvaluator
from commweave.workloads import get_workload
from toy_workload import ToyGatherMatmul


def simulated(delay_s: float, seed: int = 0) -> SimulatedEvaluator:
    """gemm-allgather's simulated landscape; every evaluation takes `delay_s` (a GPU's time)."""
    template = get_workload("gemm-allgather").template()
    return SimulatedEvaluator(template, 4, template.seed_directives().with_(comm_ctas=16), delay_s=delay_s, seed=seed)


def toy_cpu(world: int) -> Evaluator:
    """The real cascade on `world` CPU gloo workers, started now and kept for the actor's life."""
    pool = WorkerPool(world, device="cpu", job_timeout_s=120)
    pool.start()
    return Evaluator(pool, ToyGatherMatmul(), warmup=1, iters=3, seeds=2)
