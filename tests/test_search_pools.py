"""Several candidates in flight, one per evaluation pool: throughput, attribution, and pools that
die mid-candidate (re-queued, never charged to the program until it keeps killing pools)."""

from __future__ import annotations

import time

import pytest

from commweave.runtime.pool import PoolStartError
from commweave.search import Budget, Evolution, ProgramDB, SearchConfig
from commweave.search.pools import LocalPools, Placement, split_gpus
from commweave.search.simulate import SimulatedEvaluator
from commweave.workloads import get_workload

TEMPLATE = get_workload("gemm-allgather").template()
SHAPE = TEMPLATE.default_shape(4)
OPTIMUM = TEMPLATE.seed_directives().with_(comm_ctas=16)
DELAY_S = 0.4  # each evaluation's known time (the search's own Python is ~0.1 s a candidate)


def _pools(n: int, **kwargs) -> tuple[LocalPools, list[SimulatedEvaluator]]:
    judges = [SimulatedEvaluator(TEMPLATE, 4, OPTIMUM, delay_s=DELAY_S, seed=i) for i in range(n)]
    return LocalPools([(j, Placement(f"pool{i}", "node-a")) for i, j in enumerate(judges)], **kwargs), judges


def _search(tmp_path, pools: LocalPools, evaluations: int, name: str) -> tuple[float, list]:
    start = time.monotonic()
    with ProgramDB(tmp_path / f"{name}.sqlite") as db:
        Evolution(db, TEMPLATE, None, SHAPE, 4, Budget(evaluations=evaluations), SearchConfig(islands=4, seed=3),
                  pools=pools).run()
        programs = db.programs()
    pools.close()
    return time.monotonic() - start, programs


def test_pools_evaluate_in_parallel_and_results_say_where(tmp_path) -> None:
    one_s, one = _search(tmp_path, _pools(1)[0], 9, "one")
    four_s, four = _search(tmp_path, _pools(4)[0], 9, "four")
    assert len(one) == len(four) == 9
    assert [p.id for p in four] == list(range(1, 10))  # contiguous: nothing lost or recorded twice
    assert len({p.directive_key for p in four}) == 9
    # the seed, then 8 candidates: 9 evaluations in a row on one pool, 3 rounds on four
    assert one_s / four_s >= 1.6, (one_s, four_s)
    assert {p.timings["pool"] for p in four} == {"pool0", "pool1", "pool2", "pool3"}
    assert {p.timings["node"] for p in four} == {"node-a"}


class _Dying(SimulatedEvaluator):
    """A judge whose pool dies on its `die_on`-th evaluation."""

    def __init__(self, *args, die_on: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.die_on = die_on

    def evaluate(self, text, shape):
        if self.calls + 1 == self.die_on:
            self.calls += 1
            raise PoolStartError("worker pool failed to start: worker exited with code -9")
        return super().evaluate(text, shape)


def test_a_dead_pool_requeues_its_candidate_and_is_rebuilt(tmp_path) -> None:
    judges = [_Dying(TEMPLATE, 4, OPTIMUM, delay_s=0.01, die_on=3), SimulatedEvaluator(TEMPLATE, 4, OPTIMUM, delay_s=0.01)]
    rebuilt = []

    def rebuild(index: int) -> SimulatedEvaluator:
        rebuilt.append(index)
        return SimulatedEvaluator(TEMPLATE, 4, OPTIMUM, delay_s=0.01)

    pools = LocalPools([(j, Placement(f"pool{i}", "n")) for i, j in enumerate(judges)],
                       infrastructure_errors=(PoolStartError,), rebuild=rebuild)
    _, programs = _search(tmp_path, pools, 12, "dying")
    assert rebuilt == [0]
    assert len(programs) == 12 and all(p.failure != "runtime_error" for p in programs)
    assert [p.id for p in programs] == list(range(1, 13))


class _Killer(SimulatedEvaluator):
    """Every evaluation of one program kills the pool (its text carries comm_ctas 2)."""

    def evaluate(self, text, shape):
        if '"comm_ctas":2,' in text.splitlines()[0]:
            raise PoolStartError("worker exited with code -11")
        return super().evaluate(text, shape)


def test_a_program_that_keeps_killing_pools_is_blamed(tmp_path) -> None:
    pools = LocalPools([(_Killer(TEMPLATE, 4, OPTIMUM), Placement(f"pool{i}", "n")) for i in range(2)],
                       infrastructure_errors=(PoolStartError,), rebuild=lambda i: _Killer(TEMPLATE, 4, OPTIMUM))
    _, programs = _search(tmp_path, pools, 30, "killer")
    killers = [p for p in programs if p.directives["comm_ctas"] == 2]
    assert killers, "the search never proposed the killing program"
    for p in killers:
        assert p.failure == "runtime_error" and "3 pools died while evaluating this program" in p.message


def test_split_gpus() -> None:
    assert split_gpus(8, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_gpus(5, 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="--pool-gpus 4 needs 4 GPUs, this node has 2"):
        split_gpus(2, 4)
