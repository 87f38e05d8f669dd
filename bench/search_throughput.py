"""Figure: search throughput with N evaluation pools (docs/search.md, search-throughput-*.json), on a Ray cluster of this machine.

Each pool is a Ray actor whose judge takes a known time per evaluation (`--eval-s`, the simulated
evaluator sleeping as a GPU would be busy), so the figure is the scheduler's: evaluations per
minute after the seed (from its result to the last: every pool busy) with N pools over the same
with one, beside the ideal N. `--gloo` also runs pools of real CPU gloo workers judging the toy
workload, each evaluation held to `--eval-s`.

    python bench/search_throughput.py --pools 1 2 4 --evaluations 17 --eval-s 1.0
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # pool_builders, toy workload/template
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent / "tests"), os.environ.get("PYTHONPATH", "")) if p)

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from commweave.report.results import write_results  # noqa: E402
from commweave.search import Budget, Evolution, ProgramDB, SearchConfig  # noqa: E402
from commweave.search.ray_pools import RayPools  # noqa: E402
from commweave.workloads import get_workload  # noqa: E402


def run_search(pools: RayPools, template, shape, world: int, evaluations: int, islands: int) -> tuple[float, list]:
    """(seconds from the seed's result to the last result, the programs): the steady state, with
    every pool busy, not the seed's evaluation that precedes all others."""
    stamps: list[float] = []
    with tempfile.TemporaryDirectory() as tmp, ProgramDB(Path(tmp) / "run.sqlite") as db:
        Evolution(db, template, None, shape, world, Budget(evaluations=evaluations),
                  SearchConfig(islands=islands, seed=11), pools=pools,
                  on_result=lambda record, search: stamps.append(time.monotonic())).run()
        return stamps[-1] - stamps[0], db.programs()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--evaluations", type=int, default=17)
    parser.add_argument("--eval-s", type=float, default=1.0)
    parser.add_argument("--no-simulated", action="store_true", help="skip the simulated judges")
    parser.add_argument("--gloo", action="store_true", help="also time pools of real CPU gloo workers (toy workload), "
                        "each evaluation held to --eval-s")
    parser.add_argument("--gloo-evaluations", type=int, default=17, help="evaluations of a gloo run")
    args = parser.parse_args()

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
    cluster.add_node(num_cpus=4)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    rows = []
    try:
        template = get_workload("gemm-allgather").template()
        for n in [] if args.no_simulated else args.pools:
            pools = RayPools("pool_builders:simulated", {"delay_s": args.eval_s}, n, cpus_per_pool=0.5)
            try:
                seconds, programs = run_search(pools, template, template.default_shape(4), 4, args.evaluations, max(n, 2))
            finally:
                pools.close()
            nodes = sorted({p.timings["node"] for p in programs})
            rows.append({"judge": "simulated", "pools": n, "eval_s": args.eval_s, "evaluations": len(programs),
                         "seconds": round(seconds, 3), "per_min": round(60 * (len(programs) - 1) / seconds, 2),
                         "nodes": nodes})
        if args.gloo:
            from test_search_cli import ToyTemplate

            class WideToyTemplate(ToyTemplate):
                """The toy's space with 12 row-block counts, so a run has candidates for every pool."""

                def supported(self):
                    return {**super().supported(), "knob:pieces": tuple(range(1, 13))}

            toy = WideToyTemplate()
            for n in args.pools:
                pools = RayPools("pool_builders:toy_cpu", {"world": 1, "eval_s": args.eval_s}, n, cpus_per_pool=0.5)
                try:
                    seconds, programs = run_search(pools, toy, toy.default_shape(1), 1, args.gloo_evaluations, max(n, 2))
                finally:
                    pools.close()
                rows.append({"judge": "toy cascade on gloo, held", "pools": n, "eval_s": args.eval_s,
                             "evaluations": len(programs), "seconds": round(seconds, 3),
                             "per_min": round(60 * (len(programs) - 1) / seconds, 2),
                             "nodes": sorted({p.timings["node"] for p in programs})})
    finally:
        ray.shutdown()
        cluster.shutdown()
    for row in rows:
        base = next(r for r in rows if r["judge"] == row["judge"] and r["pools"] == min(
            x["pools"] for x in rows if x["judge"] == row["judge"]))
        row["speedup"] = round(row["per_min"] / base["per_min"], 2)
        row["of_ideal"] = round(row["speedup"] / (row["pools"] / base["pools"]), 2)
    path = write_results("search-throughput-cpu", {"cores": os.cpu_count(), "rows": rows}, sys.argv)
    print(f"{'judge':<36} {'pools':>5} {'evals':>5} {'s':>7} {'/min':>7} {'x':>5} {'of ideal':>8}")
    for r in rows:
        print(f"{r['judge']:<36} {r['pools']:>5} {r['evaluations']:>5} {r['seconds']:>7.1f} {r['per_min']:>7.1f} "
              f"{r['speedup']:>5.2f} {r['of_ideal']:>8.2f}")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
