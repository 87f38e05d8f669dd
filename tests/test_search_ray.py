"""The search across a Ray cluster on this machine (a head and one more node process on
loopback): pools of CPU gloo workers as actors, results attributed to pool and node, and an actor
and a node lost mid-run without losing or duplicating an evaluation."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="needs the cluster extra: pip install 'commweave[cluster]'")
from ray.cluster_utils import Cluster  # noqa: E402

from commweave.search import Budget, Evolution, ProgramDB, SearchConfig  # noqa: E402
from commweave.search.ray_pools import RayPools  # noqa: E402
from commweave.workloads import get_workload  # noqa: E402
from test_search_cli import ToyTemplate  # noqa: E402

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def cluster():
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "include_dashboard": False})
    extra = c.add_node(num_cpus=3)
    ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    try:
        yield c, extra
    finally:
        ray.shutdown()
        c.shutdown()


def _ids_contiguous(programs) -> bool:
    return [p.id for p in programs] == list(range(1, len(programs) + 1))


def test_three_pools_of_gloo_workers_on_the_cluster(cluster, tmp_path) -> None:
    template = ToyTemplate()
    pools = RayPools("pool_builders:toy_cpu", {"world": 1}, 3, cpus_per_pool=0.5)
    try:
        with ProgramDB(tmp_path / "ray.sqlite") as db:
            Evolution(db, template, None, template.default_shape(1), 1, Budget(evaluations=4),
                      SearchConfig(islands=3, seed=1), pools=pools).run()
            programs = db.programs()
    finally:
        pools.close()
    assert len(programs) == 4 and _ids_contiguous(programs)
    assert {p.directives["knobs"]["scale"] for p in programs if p.ok} == {1.0}
    assert {p.failure for p in programs if not p.ok} <= {"wrong_result"}
    assert len({p.timings["pool"] for p in programs}) >= 2
    assert len({p.timings["node"] for p in programs}) >= 1
    assert all("/" in p.timings["node"] for p in programs)  # host/node id, from the actor's own node


def test_an_actor_and_a_node_lost_mid_run(cluster, tmp_path) -> None:
    c, extra = cluster
    template = get_workload("gemm-allgather").template()
    pools = RayPools("pool_builders:simulated", {"delay_s": 0.3}, 4, cpus_per_pool=0.5)
    path = tmp_path / "lost.sqlite"
    done = threading.Event()

    def search() -> None:
        with ProgramDB(path) as db:
            Evolution(db, template, None, template.default_shape(4), 4, Budget(evaluations=24),
                      SearchConfig(islands=4, seed=2), pools=pools).run()
        done.set()

    thread = threading.Thread(target=search)
    thread.start()
    try:
        def evaluated() -> int:
            if not path.exists():
                return 0
            with ProgramDB(path) as db:
                return db.count()

        deadline = time.monotonic() + 120
        while evaluated() < 8 and time.monotonic() < deadline:
            time.sleep(0.2)
        pools.kill(0)
        while evaluated() < 12 and time.monotonic() < deadline:
            time.sleep(0.2)
        c.remove_node(extra)
        assert done.wait(timeout=120), "the run did not finish after losing an actor and a node"
    finally:
        thread.join(timeout=60)
        pools.close()
    with ProgramDB(path) as db:
        programs = db.programs()
    assert len(programs) == 24 and _ids_contiguous(programs)
    assert len({p.directive_key for p in programs}) == 24  # nothing evaluated twice
    assert not any(p.failure == "runtime_error" for p in programs)  # lost pools were not charged
    assert pools.restarts >= 1
