"""The `commweave` command: doctor, list, bench, evolve, report, export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from commweave.runtime.pool import apply_safe_env
from commweave.report.results import RESULTS_DIR

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Co-design computation and communication on multi-GPU machines.")
console = Console()


@app.callback()
def _safe_environment() -> None:
    """NVLink multicast stays off in this process and every worker it starts."""
    apply_safe_env()


def _fail(message: str, code: int = 2) -> None:
    """One clear line on stderr, then a non-zero exit."""
    Console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    raise typer.Exit(code)


def _require_gpus(n: int, what: str) -> None:
    from commweave.runtime.capabilities import cuda_device_count

    have = cuda_device_count()
    if have < n:
        _fail(f"{what} needs {n} CUDA GPUs; this machine has {have}.")


@app.command()
def doctor() -> None:
    """GPUs, links, NCCL version, LSA/GIN, nvcc: what this machine offers commweave."""
    from commweave.runtime import PoolStartError, WorkerPool
    from commweave.runtime.capabilities import host_capabilities

    caps = host_capabilities()
    table = Table(title="commweave doctor", show_header=False)
    for key in ("torch", "torch_cuda", "gpus", "nvcc", "nccl_headers", "nccl_library"):
        table.add_row(key, str(caps[key]))
    table.add_row("rdma_nics", ", ".join(caps["rdma_nics"]) or "none")
    console.print(table)
    if caps["topology"]:
        console.print(caps["topology"], highlight=False)
    if caps["gpus"] < 1:
        _fail("no CUDA GPU found: device checks (LSA, GIN, self-test) skipped.", code=1)
    world = caps["gpus"]
    try:
        with WorkerPool(world, job_timeout_s=120) as pool:
            probe = pool.run("commweave.runtime.selftest:probe")
            test = pool.run("commweave.runtime.selftest:lsa_allreduce", count=1 << 20) if world > 1 else None
    except PoolStartError as exc:
        _fail(str(exc))
    if not probe.ok:
        _fail(f"probe failed: {probe.first_failure()}")
    info = probe.values[0]
    console.print(f"NCCL loaded {info['nccl_loaded']} (torch reports {info['nccl_torch']}); GPU {info['gpu']} x{world}")
    console.print(f"LSA: {'yes' if info['lsa'] else 'no'} (team of {info['lsa_size']})")
    console.print(f"GIN: {'yes' if info['gin'] else 'no — ' + info['gin_reason']}")
    if test is not None:
        ok = test.ok and all(v["ok"] for v in test.values)
        console.print(f"LSA all-reduce self-test vs NCCL: {'passed' if ok else 'FAILED'}")
        if not ok:
            raise typer.Exit(1)


@app.command("list")
def list_workloads() -> None:
    """Workloads, their programs and default shapes."""
    from commweave.workloads import registry

    table = Table(title="workloads")
    table.add_column("name", no_wrap=True)  # a name is what a user types: never cut
    for col in ("summary", "GPUs", "programs (baselines, seed)", "bench shapes (4 GPUs)"):
        table.add_column(col)
    for name, wl in registry().items():
        programs = f"{', '.join(wl.baselines)}; {wl.seed}"
        labels = [s.label for s in wl.bench_shapes(max(wl.world_sizes))]
        shapes = ", ".join(labels[:6]) + (f", … ({len(labels)} in all)" if len(labels) > 6 else "")
        table.add_row(name, wl.summary, ", ".join(map(str, wl.world_sizes)), programs, shapes)
    console.print(table)


@app.command()
def bench(
    workload: str = typer.Argument(..., help="workload name (see `commweave list`)"),
    gpus: int = typer.Option(4, "--gpus", help="GPUs (one worker each)"),
    shapes: list[str] = typer.Option(None, "--shapes", help="shapes to time, comma-separated or repeated (default: the workload's bench shapes)"),
    candidate: Path = typer.Option(None, "--candidate", help="a program file to time as 'ours' instead of the seed"),
    iters: int = typer.Option(20, "--iters", min=20, help="timed iterations per program and shape"),
    warmup: int = typer.Option(5, "--warmup", min=1),
    seeds: int = typer.Option(2, "--seeds", min=2, help="fresh random inputs per correctness check"),
    job_timeout: float = typer.Option(600.0, "--job-timeout", help="seconds before a hung job is killed"),
    out_dir: Path = typer.Option(RESULTS_DIR, "--out-dir", help="where the results JSON goes"),
    device: str = typer.Option("cuda", "--device", help="cuda, or cpu for a dry run on gloo workers (CPU programs only)"),
) -> None:
    """Check and time a workload's baselines and our program side by side, against the floor."""
    from rich.progress import Progress

    from commweave.contracts.verdict import EvaluationError
    from commweave.evaluate.bench import BenchStep, bench_workload
    from commweave.report.bench import comparison_table, notes
    from commweave.report.results import write_results
    from commweave.runtime import PoolStartError, WorkerPool

    try:
        wl = _workload_named(workload)
        wl.check_world_size(gpus)
        texts = [t for item in shapes or [] for t in item.split(",") if t]
        chosen = [wl.parse_shape(text, gpus) for text in texts] if texts else wl.bench_shapes(gpus)
        if candidate is not None and not candidate.is_file():
            raise ValueError(f"--candidate {candidate}: no such file")
        ours_text = candidate.read_text() if candidate is not None else wl.program_text(wl.seed)
        programs = {name: wl.program_text(name) for name in wl.baselines} | {"ours": ours_text}
    except (KeyError, ValueError) as exc:
        _fail(str(exc).strip("'\""))
    if device == "cuda":
        _require_gpus(gpus, f"bench {workload} --gpus {gpus}")
    elif device != "cpu":
        _fail(f"--device must be cuda or cpu, not {device!r}")
    try:
        with WorkerPool(gpus, device=device, job_timeout_s=job_timeout) as pool, \
                Progress(console=console, transient=True) as progress:
            task = progress.add_task("starting", total=None)

            def show(step: BenchStep) -> None:
                progress.update(task, description=step.description, completed=step.done, total=step.total)

            report = bench_workload(pool, wl, chosen, programs, yardsticks=list(wl.yardsticks), iters=iters,
                                    warmup=warmup, seeds=seeds, job_timeout_s=job_timeout,
                                    meta={"candidate": str(candidate) if candidate else None}, progress=show)
    except (PoolStartError, EvaluationError) as exc:
        _fail(str(exc))
    path = write_results(f"bench-{wl.name}-{gpus}gpu", report.to_json(), out_dir=out_dir,
                         provenance=report.provenance)
    console.print(comparison_table(report))
    for line in notes(report):
        console.print(line, highlight=False, markup=False)
    console.print(f"results: {path}", highlight=False)


# -- the slow path: evolve, report, export -------------------------------------------------------
@app.command()
def evolve(
    workload: str = typer.Argument(..., help="workload name (see `commweave list`)"),
    gpus: int = typer.Option(4, "--gpus", help="GPUs (one worker each)"),
    budget: str = typer.Option("200", "--budget", help="evaluations (200) or wall time (20m, 90s, 1h)"),
    shape: str = typer.Option(None, "--shape", help="the shape to optimise (default: the template's, 8192^3 for gemm-allgather)"),
    islands: int = typer.Option(4, "--islands", min=1),
    seed: int = typer.Option(0, "--seed", help="random seed of the search"),
    resume: Path = typer.Option(None, "--resume", help="a run database to continue (its workload, shape, GPUs and budget)"),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="where a new run's database goes"),
    iters: int = typer.Option(20, "--iters", min=1, help="timed iterations per candidate"),
    warmup: int = typer.Option(5, "--warmup", min=1),
    seeds: int = typer.Option(2, "--seeds", min=2, help="fresh random inputs per correctness check"),
    compile_workers: int = typer.Option(8, "--compile-workers", min=1, help="CPU threads compiling ahead of the GPUs"),
    job_timeout: float = typer.Option(120.0, "--job-timeout", help="seconds before a hung candidate is killed"),
    stop_after: str = typer.Option(None, "--stop-after", help="leave this invocation after this long (9m, 540s) with "
                                   "budget left; --resume continues (for machines lent in short slots)"),
    llm: list[str] = typer.Option(None, "--llm", help="a model for the LLM islands: a name from the LLM config, or "
                                  "provider:model (openai:gpt-4.1; openai:qwen@http://localhost:8000/v1 for a local "
                                  "server); repeat for several (a bandit picks by fitness gain per dollar)"),
    llm_config: Path = typer.Option(None, "--llm-config", help="TOML file of models (default: $COMMWEAVE_LLM_CONFIG, "
                                    "else ./commweave-llm.toml)"),
    llm_budget: float = typer.Option(None, "--llm-budget", min=0, help="dollars the LLM calls may spend; then the LLM "
                                     "islands stop proposing (on --resume: a new cap for the whole run)"),
    llm_islands: int = typer.Option(None, "--llm-islands", min=0, help="islands that propose with the LLM (default "
                                    "with --llm: half of --islands, at least 1)"),
) -> None:
    """Search the workload's directive space and template knobs on this machine's GPUs. Offline
    proposer by default; with --llm, some islands ask a model for code-level changes instead.
    Every evaluated program (and every LLM call) goes to one SQLite file per run; --resume
    continues a run killed at any moment."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from commweave.contracts.verdict import EvaluationError
    from commweave.runtime import PoolStartError, WorkerPool
    from commweave.search.driver import plan_run, run_meta, run_on_pool

    try:
        plan = plan_run(workload, gpus=gpus, budget=budget, shape=shape, islands=islands, seed=seed, resume=resume,
                        runs_dir=runs_dir, compile_workers=compile_workers, llm=llm or (), llm_config=llm_config,
                        llm_budget=llm_budget, llm_islands=llm_islands, stop_after=stop_after)
    except (KeyError, ValueError, LookupError, FileNotFoundError, ImportError) as exc:
        _fail(str(exc).strip("'\"") if isinstance(exc, KeyError) else str(exc))  # KeyError's str() is a repr
    _require_gpus(plan.gpus, f"evolve {workload} --gpus {plan.gpus}")
    path, models = plan.path, plan.models
    console.print(f"run: {path} ({plan.shape}, {plan.gpus} GPUs, budget {plan.budget.to_dict()})", highlight=False)
    if models:
        cap = f"${plan.llm_budget_usd:g}" if plan.llm_budget_usd is not None else "the run's" if plan.resumed else "no cap"
        console.print(f"LLM islands: {plan.config.llm_islands} of {plan.config.islands} "
                      f"({', '.join(m.name for m in models)}; budget {cap})", highlight=False)
    try:
        with WorkerPool(plan.gpus, job_timeout_s=job_timeout) as pool, \
                Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console) as progress:
            best, count, paused = run_on_pool(plan, pool, iters=iters, warmup=warmup, seeds=seeds,
                                              job_timeout_s=job_timeout, progress=progress)
    except (PoolStartError, EvaluationError) as exc:
        _fail(f"{exc} (every evaluated program is in {path}; continue with --resume {path})")
    except KeyboardInterrupt:
        _fail(f"interrupted; every evaluated program is in {path}: continue with --resume {path}", code=130)
    if models:
        after = run_meta(path)
        console.print(f"LLM: ${after.get('llm_spent_usd', 0.0):.4f} spent; run ended: {after.get('stop_reason')}",
                      highlight=False)
    if paused:
        console.print(f"stopped after {stop_after} with budget left ({count} evaluated so far); continue with "
                      f"commweave evolve {workload} --resume {path}", highlight=False)
    if best is None:
        console.print(f"{count} programs evaluated, none correct. run: {path}", highlight=False)
        raise typer.Exit(0 if paused else 1)
    console.print(f"best: program #{best.id}, {best.fitness:.2f}x over {best.timings.get('baseline')} "
                  f"({count} evaluated). Next: commweave report {path}; commweave export {path} --out best.py",
                  highlight=False)


@app.command()
def report(
    run: Path = typer.Argument(..., help="a run database written by `commweave evolve`"),
    out: Path = typer.Option(None, "--out", help="output folder (default: beside the database, <name>-report)"),
) -> None:
    """One self-contained HTML page for a run (plots embedded), with the plots as PNGs beside it."""
    from commweave.report.html import write_report

    try:
        page = write_report(run, out)
    except (FileNotFoundError, ValueError) as exc:
        _fail(str(exc))
    console.print(f"report: {page}", highlight=False)


@app.command()
def export(
    run: Path = typer.Argument(..., help="a run database written by `commweave evolve`"),
    out: Path = typer.Option(..., "--out", help="file to write the best program to"),
) -> None:
    """Write a run's best program to a file: the program text (its directive set in the first
    line) plus a line naming its workload, so it loads as a PyTorch op with
    `commweave.ops.load(FILE)`. Time it beside the baselines with
    `commweave bench WORKLOAD --candidate FILE`."""
    from commweave.ops.exported import export_text
    from commweave.search.db import ProgramDB
    from commweave.search.driver import run_meta

    try:
        meta = run_meta(run)
    except (FileNotFoundError, ValueError) as exc:
        _fail(str(exc))
    with ProgramDB(run) as db:
        best = db.best()
    if best is None:
        _fail(f"run {run} has no correct program to export")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(export_text(best.code, meta["workload"], run=run.name, program_id=best.id,
                               fitness=round(best.fitness, 4), baseline=best.timings.get("baseline"),
                               shape=meta.get("shape"), gpus=meta.get("gpus")))
    console.print(f"program #{best.id} ({best.fitness:.2f}x over {best.timings.get('baseline')} on {meta.get('shape')}) "
                  f"-> {out}. Time it: commweave bench {meta['workload']} --gpus {meta['gpus']} --candidate {out}; "
                  f"use it from PyTorch: commweave.ops.load({str(out)!r})",
                  highlight=False)


# -- agents -----------------------------------------------------------------------------------------
agent_app = typer.Typer(no_args_is_help=True, help="LLM agents that write programs: the fast path.")
app.add_typer(agent_app, name="agent")


def _workload_named(name: str) -> Any:
    """A registered workload, or one given by its class as 'module:Class' (importable here and in
    the workers, constructible without arguments)."""
    from commweave.runtime.pool import resolve_function
    from commweave.contracts.workload import Workload
    from commweave.workloads import get_workload

    if ":" not in name:
        return get_workload(name)
    try:
        workload = resolve_function(name)()
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"workload class {name!r} cannot be imported: {exc}") from exc
    if not isinstance(workload, Workload):
        raise ValueError(f"{name} is not a commweave Workload")
    return workload


@agent_app.command("fast-path")
def fast_path(
    program: Path = typer.Argument(..., help="a host-driven program: Python (torch.distributed) in the program format, or CUDA with host NCCL calls"),
    workload: str = typer.Option(..., "--workload", help="the workload it computes (see `commweave list`), or 'module:Class'"),
    gpus: int = typer.Option(4, "--gpus", help="GPUs (one worker each)"),
    shape: str = typer.Option(None, "--shape", help="shape to benchmark the result at (default: the template's, else the first bench shape)"),
    bench: bool = typer.Option(True, "--bench/--no-bench", help="time the result beside the workload's baselines"),
    llm: str = typer.Option(None, "--llm", help="the model: a name from the LLM config, or provider:model "
                            "(openai:gpt-4.1; openai:qwen@http://localhost:8000/v1 for a local server); "
                            "without it the workload's template is instantiated at the conservative directive set"),
    llm_config: Path = typer.Option(None, "--llm-config", help="TOML file of models (default: $COMMWEAVE_LLM_CONFIG, else ./commweave-llm.toml)"),
    llm_budget: float = typer.Option(None, "--llm-budget", min=0, help="dollars the LLM calls may spend; then the run stops"),
    attempts: int = typer.Option(3, "--attempts", min=1, help="attempts per stage (A, then B)"),
    out: Path = typer.Option(None, "--out", help="file for the converted program (default: runs/fast-path-<workload>-<gpus>gpu-<time>.py); "
                             "the attempt log goes beside it as <name>.attempts.json"),
    device: str = typer.Option("cuda", "--device", help="cuda, or cpu for a dry run of the loop on gloo workers "
                               "(no device-initiated code can run there, so stage B may keep host calls)"),
    job_timeout: float = typer.Option(300.0, "--job-timeout", help="seconds before a hung candidate is killed"),
) -> None:
    """Convert a host-driven program into a device-initiated one: stage A adds symmetric buffers,
    windows and a device communicator while keeping the host collectives; stage B replaces them
    under the conservative directives. The cascade judges every attempt; an LLM judge diagnoses
    failures for the next attempt."""
    import datetime as dt

    from commweave.agents import AnalysisError, FastPath, FastPathError, analyze_program
    from commweave.evaluate.evaluator import Evaluator
    from commweave.evaluate.floor import calibrate
    from commweave.contracts.verdict import EvaluationError
    from commweave.llm import Ledger, client_for, load_models, resolve_model
    from commweave.runtime import PoolStartError, WorkerPool

    if device not in ("cuda", "cpu"):
        _fail(f"--device must be cuda or cpu, not {device!r}")
    try:
        wl = _workload_named(workload)
        wl.check_world_size(gpus)
        analyze_program(program)  # the wrong kind of file, or one without collectives, fails here
        try:
            template = wl.template()
        except LookupError:
            template = None
        if llm is None and (llm_config is not None or llm_budget is not None):
            raise ValueError("--llm-config and --llm-budget need --llm MODEL")
        client = client_for(resolve_model(llm, load_models(llm_config)), Ledger(llm_budget)) if llm else None
        if client is None and template is None:
            raise ValueError(f"no LLM given (--llm) and workload {wl.name!r} has no template to instantiate")
        bench_shape = None
        if bench:
            bench_shape = (wl.parse_shape(shape, gpus) if shape else
                           template.default_shape(gpus) if template is not None else wl.bench_shapes(gpus)[0])
    except (KeyError, ValueError, AnalysisError, FileNotFoundError, ImportError) as exc:
        _fail(str(exc).strip("'\"") if isinstance(exc, KeyError) else str(exc))
    if device == "cuda":
        _require_gpus(gpus, f"agent fast-path --gpus {gpus}")
    if out is None:
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        out = Path("runs") / f"fast-path-{wl.name}-{gpus}gpu-{stamp}.py"

    def say(line: str) -> None:
        console.print(line, highlight=False, markup=False)

    if device == "cpu":
        say("dry run on CPU workers: stage B may keep host calls (no device-initiated code runs on a CPU)")
    try:
        with WorkerPool(gpus, device=device, job_timeout_s=job_timeout) as pool:
            rates = calibrate(pool) if bench_shape is not None else None
            evaluator = Evaluator(pool, wl, rates=rates, job_timeout_s=job_timeout)
            agent = FastPath(wl, evaluator, client, world_size=gpus, attempts=attempts,
                             require_device_initiated=device == "cuda", log=say)
            result = agent.run(program, bench_shape)
    except (PoolStartError, EvaluationError, FastPathError) as exc:
        _fail(str(exc))
    written, log = result.write(out)
    say(result.message)
    if written is None:
        say(f"no program written; every attempt is in {log}")
        raise typer.Exit(1)
    hint = f". Time it: commweave bench {wl.name} --gpus {gpus} --candidate {written}" if ":" not in workload else ""
    say(f"program: {written} (attempt log: {log}){hint}")


if __name__ == "__main__":  # pragma: no cover
    app()
