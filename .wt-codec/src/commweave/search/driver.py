"""Starting or resuming a run: the workload's template, the run's database file, a progress bar.

`commweave evolve` is this plus a GPU pool and the real Evaluator; anything with
`evaluate(text, shape)` can drive it (the tests use the simulated evaluator on a CPU).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any, Mapping, Sequence

from commweave.search.db import ProgramDB
from commweave.search.evolve import Budget, Evolution, SearchConfig
from commweave.space import Template

RUNS_DIR = Path("runs")


def template_for(workload: Any) -> Template:
    """The workload's design-space template (`Workload.template()`; LookupError if it has none)."""
    return workload.template()


def new_run_path(workload: str, gpus: int, runs_dir: Path = RUNS_DIR) -> Path:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return Path(runs_dir) / f"evolve-{workload}-{gpus}gpu-{stamp}.sqlite"


def run_meta(path: Path) -> dict[str, Any]:
    """A run's metadata (workload, shape, gpus, budget, ...); error if it is not a run database."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no run database at {path}")
    with ProgramDB(path) as db:
        meta = db.meta()
    if "workload" not in meta:
        raise ValueError(f"{path} holds no run (no metadata)")
    return meta


def evolve(db_path: Path, template: Template, evaluator: Any, shape: Any, world_size: int, budget: Budget,
           config: SearchConfig, *, rates: Any = None, workload: Any = None, capabilities: Any = None,
           progress: Any = None, stop_after_s: float | None = None, llm_models: Sequence[Any] = (),
           llm_budget_usd: float | None = None, hardware: Mapping[str, Any] | None = None):
    """Run (or resume) the search; with a rich `Progress`, one bar tracks the budget and the best
    speedup so far (and the LLM dollars spent). `llm_models` (ModelConfigs) propose on the last
    `config.llm_islands` islands. Returns (best record or None, evaluations in the database,
    whether it stopped at `stop_after_s` with budget left)."""
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

        search = Evolution(db, template, evaluator, shape, world_size, budget, config, rates=rates, workload=workload,
                           capabilities=capabilities, on_result=on_result, llm_models=llm_models,
                           llm_budget_usd=llm_budget_usd, hardware=hardware)
        if progress is not None:
            task = progress.add_task("starting", total=1000)
        best = search.run(stop_after_s)
        return best, db.count(), search.paused()
