"""Starting or resuming a run: what it runs (`plan_run`: a new run's arguments, or a resumed run's
database, reconciled here and nowhere else before the search starts), the run's database file, the
machine's facts and a progress bar.

`commweave evolve` is `plan_run`, then `run_on_pools` (worker pools of this node) or `run_on_cluster` (Ray); anything with `evaluate(text, shape)`
can drive `evolve` (the tests use the simulated evaluator on a CPU).
"""

from __future__ import annotations

import datetime as dt
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from commweave.contracts.workload import Shape
from commweave.llm import ModelConfig, client_for, load_models, resolve_model
from commweave.search.db import ProgramDB
from commweave.search.evolve import Budget, Evolution, SearchConfig
from commweave.search.pools import LocalPools, Placement, Pools
from commweave.space import Template

RUNS_DIR = Path("runs")
#: timed and warm-up batches per program of each candidate (`commweave evolve --iters/--warmup`):
#: a timed batch lasts >= 12 ms on GPUs and is the mean of its calls, so a candidate's median
#: rests on hundreds of calls with 10 as with 20, at about half the judge's time per candidate
SEARCH_ITERS, SEARCH_WARMUP = 10, 3


def template_for(workload: Any) -> Template:
    """The workload's design-space template (`Workload.template()`; LookupError if it has none)."""
    return workload.template()


def new_run_path(workload: str, gpus: int, runs_dir: Path = RUNS_DIR) -> Path:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return Path(runs_dir) / f"evolve-{workload}-{gpus}gpu-{stamp}.sqlite"


def run_meta(path: Path) -> dict[str, Any]:
    """A run's metadata (workload, shape, gpus, budget, ...); error if it is not a run database."""
    with ProgramDB(path, readonly=True) as db:
        meta = db.meta()
    if "workload" not in meta:
        raise ValueError(f"{path} holds no run (no metadata)")
    return meta


def evolve(db_path: Path, template: Template, evaluator: Any, shape: Any, world_size: int, budget: Budget,
           config: SearchConfig, *, rates: Any = None, capabilities: Any = None,
           progress: Any = None, stop_after_s: float | None = None, llm_models: Sequence[Any] = (),
           llm_budget_usd: float | None = None, hardware: Mapping[str, Any] | None = None, pools: Pools | None = None,
           simulated: bool = False):
    """Run (or resume) the search; with a rich `Progress`, one bar tracks the budget and the best
    speedup so far (and the LLM dollars spent). `llm_models` (ModelConfigs) propose on the last
    `config.llm_islands` islands; `pools` evaluates several candidates at once (default: `evaluator`
    alone); `simulated` marks the run as judged by a simulated evaluator before any evaluation.
    Returns (best record or None, evaluations in the database, whether it stopped at
    `stop_after_s` with budget left)."""
    with ProgramDB(db_path) as db:
        task = None

        def on_result(record: Any, search: Evolution) -> None:
            if progress is None:
                return
            best = search.best
            what = f"best {best.fitness:.2f}x (#{best.id})" if best else "no correct program yet"
            spent = f" · LLM ${search.ledger.spent_usd:.2f}" if search.llm is not None else ""
            progress.update(task, completed=min(search.fraction(), 1.0) * 1000,
                            description=f"{search.phase()} · {search.evaluated} evaluated · {what}{spent}")

        search = Evolution(db, template, evaluator, shape, world_size, budget, config, rates=rates,
                           capabilities=capabilities, on_result=on_result, llm_models=llm_models,
                           llm_budget_usd=llm_budget_usd, hardware=hardware, pools=pools)
        if simulated:
            db.set_meta(simulated=True)
        if progress is not None:
            task = progress.add_task("starting", total=1000)
        best = search.run(stop_after_s)
        return best, db.count(), search.paused()


@dataclass(frozen=True)
class RunPlan:
    """What a run searches, where it is stored and with which models: a new run's arguments, or a
    resumed run's own settings (its database's metadata wins over the arguments)."""

    path: Path
    template: Template
    shape: Shape
    gpus: int
    budget: Budget
    config: SearchConfig
    models: tuple[ModelConfig, ...] = ()
    llm_budget_usd: float | None = None  # None: the resumed run's cap, else none
    stop_after_s: float | None = None
    resumed: bool = False


def parse_budget(text: str, option: str = "--budget") -> Budget:
    """`Budget.parse`, saying "must be positive" for a zero or negative count or time."""
    number = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*[smh]?\s*", text.lower())
    if number and float(number.group(1)) <= 0:
        raise ValueError(f"{option} {text!r} must be positive")
    return Budget.parse(text)


def plan_run(workload: str, *, gpus: int = 4, budget: str = "200", shape: str | None = None, islands: int = 4,
             seed: int = 0, resume: Path | None = None, runs_dir: Path = RUNS_DIR, compile_workers: int = 8,
             llm: Sequence[str] = (), llm_config: Path | None = None, llm_budget: float | None = None,
             llm_islands: int | None = None, stop_after: str | None = None) -> RunPlan:
    """The run `commweave evolve` asked for. With `resume`, the run's workload must be `workload`,
    and its GPUs, shape, islands, seed, budget (and models and LLM islands, unless `llm` names new
    models) replace the arguments. Every bad argument is a ValueError (KeyError for an unknown
    workload, LookupError for one without a template, FileNotFoundError for a missing database,
    ImportError for a missing LLM SDK), raised before any GPU starts."""
    from commweave.workloads import get_workload

    meta: dict[str, Any] = {}
    if resume is not None:
        meta = run_meta(resume)
        if meta["workload"] != workload:
            raise ValueError(f"{resume} is a run of {meta['workload']!r}, not {workload!r}")
        gpus, shape, islands, seed = meta["gpus"], meta["shape"], meta["islands"], meta.get("seed", seed)
        run_budget = Budget(**meta["budget"])
    else:
        run_budget = parse_budget(budget)
    # models first: an unknown name, a missing SDK or key is said before any GPU starts
    if llm:
        found = load_models(llm_config)
        models = [resolve_model(spec, found) for spec in llm]
    else:
        models = [ModelConfig(**m) for m in meta.get("llm_models", [])]  # a resumed LLM run keeps its models
        if not models and (llm_config or llm_budget is not None or llm_islands):
            raise ValueError("--llm-config, --llm-budget and --llm-islands need --llm MODEL")
    for model in models:
        client_for(model)
    if llm_islands is None:
        llm_islands = (meta.get("config", {}).get("llm_islands") or max(1, islands // 2)) if models else 0
    if models and not 1 <= llm_islands <= islands:
        raise ValueError(f"--llm-islands {llm_islands} must be between 1 and the {islands} islands with --llm")
    stop_after_s = None
    if stop_after is not None:
        stop_after_s = parse_budget(stop_after, "--stop-after").seconds
        if stop_after_s is None:
            raise ValueError(f"--stop-after {stop_after!r} must be a time (9m, 540s), not a number of evaluations")
    wl = get_workload(workload)
    wl.check_world_size(gpus)
    template = template_for(wl)
    chosen = wl.parse_shape(shape, gpus) if shape else template.default_shape(gpus)
    config = SearchConfig(islands=islands, compile_workers=compile_workers, seed=seed, llm_islands=llm_islands)
    path = resume if resume is not None else new_run_path(workload, gpus, runs_dir)
    return RunPlan(Path(path), template, chosen, gpus, run_budget, config, tuple(models), llm_budget, stop_after_s,
                   resume is not None)


def run_on_pools(plan: RunPlan, pools: Sequence[Any], *, iters: int = SEARCH_ITERS, warmup: int = SEARCH_WARMUP,
                 seeds: int = 2, job_timeout_s: float | None = None, progress: Any = None, labels: Sequence[str] = ()):
    """Measure the first pool's machine (rates for the floor, capabilities and facts for the
    proposers), then `evolve` the plan with one real Evaluator per worker pool, a candidate in
    flight on each (`labels` name the pools, e.g. their GPUs). Returns what `evolve` returns."""
    from commweave.evaluate.evaluator import Evaluator
    from commweave.evaluate.floor import calibrate
    from commweave.runtime.pool import PoolStartError
    from commweave.space import Capabilities

    first = pools[0]
    rates = calibrate(first)
    probe = first.run("commweave.runtime.selftest:probe")
    capabilities = Capabilities.from_probe(probe.values[0]) if probe.ok else \
        Capabilities(False, f"probe failed: {probe.first_failure()}")
    info = probe.values[0] if probe.ok else {}
    hardware = {"GPUs": plan.gpus, **{label: info[key] for key, label in (("gpu", "GPU"), ("nccl_loaded", "NCCL"),
                                                                         ("lsa_size", "LSA (NVLink) team size"))
                                      if key in info}}
    evaluators = [Evaluator(pool, plan.template.workload, seeds=seeds, warmup=warmup, iters=iters, rates=rates,
                            job_timeout_s=job_timeout_s, fitness_baseline_only=True) for pool in pools]
    names = list(labels) or [f"pool{i}" for i in range(len(pools))]
    local = LocalPools([(ev, Placement(name, socket.gethostname())) for ev, name in zip(evaluators, names)],
                       infrastructure_errors=(PoolStartError,))
    try:
        return evolve(plan.path, plan.template, evaluators[0], plan.shape, plan.gpus, plan.budget, plan.config,
                      rates=rates, capabilities=capabilities, progress=progress, stop_after_s=plan.stop_after_s,
                      llm_models=plan.models, llm_budget_usd=plan.llm_budget_usd, hardware=hardware, pools=local)
    finally:
        local.close()


def node_evaluator(workload: str, world: int, iters: int, warmup: int, seeds: int, job_timeout_s: float | None):
    """A pool's judge on a cluster node (built inside its Ray actor, which holds `world` GPUs):
    worker processes on those GPUs, the node's own rates for the floor, the real Evaluator."""
    from commweave.evaluate.evaluator import Evaluator
    from commweave.evaluate.floor import calibrate
    from commweave.runtime.pool import WorkerPool
    from commweave.workloads import get_workload

    pool = WorkerPool(world, job_timeout_s=job_timeout_s or 120.0)
    pool.start()
    return Evaluator(pool, get_workload(workload), seeds=seeds, warmup=warmup, iters=iters, rates=calibrate(pool),
                     job_timeout_s=job_timeout_s, fitness_baseline_only=True)


def run_on_cluster(plan: RunPlan, address: str, *, iters: int = SEARCH_ITERS, warmup: int = SEARCH_WARMUP,
                   seeds: int = 2, job_timeout_s: float | None = None, progress: Any = None):
    """`evolve` the plan on a Ray cluster (`address`: "auto" or host:port): one pool per `plan.gpus`
    GPUs the cluster has, each a Ray actor on one node (`search.ray_pools`). The workload must be
    installed on every node; the database stays here. Returns what `evolve` returns."""
    from commweave.search.ray_pools import RayPools, import_ray

    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus < plan.gpus:
        raise ValueError(f"the Ray cluster at {address} has {gpus} GPUs; a pool of this run needs {plan.gpus}")
    kwargs = {"workload": plan.template.workload.name, "world": plan.gpus, "iters": iters, "warmup": warmup,
              "seeds": seeds, "job_timeout_s": job_timeout_s}
    pools = RayPools("commweave.search.driver:node_evaluator", kwargs, gpus // plan.gpus, gpus_per_pool=plan.gpus)
    try:
        return evolve(plan.path, plan.template, None, plan.shape, plan.gpus, plan.budget, plan.config,
                      progress=progress, stop_after_s=plan.stop_after_s, llm_models=plan.models,
                      llm_budget_usd=plan.llm_budget_usd, hardware={"GPUs per pool": plan.gpus, "pools": pools.slots},
                      pools=pools)
    finally:
        pools.close()
