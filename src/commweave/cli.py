"""The `commweave` command: doctor, list, bench, evolve, report, export."""

from __future__ import annotations

from dataclasses import asdict
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
    """GPUs, links, NCCL version, LSA/GIN, nvcc, and the confinement candidates get here."""
    from commweave.runtime import PoolStartError, WorkerPool
    from commweave.runtime.capabilities import host_capabilities
    from commweave.runtime.confine import probe_cuda as confinement_status_cuda
    from commweave.runtime.confine import status as confinement_status

    console.print("[bold]candidate confinement[/]")
    for check in confinement_status():
        mark = "[green]yes[/]" if check.in_force else "[bold red]NO[/] "
        console.print(f"  {mark}  {escape(check.name)}: {escape(check.detail)}", highlight=False, soft_wrap=True)

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
    cuda = confinement_status_cuda(["everything"])
    if not cuda[0].in_force:  # name the piece the driver cannot live with
        cuda = confinement_status_cuda()
    for check in cuda:
        mark = "[green]yes[/]" if check.in_force else "[bold red]NO[/] "
        console.print(f"  {mark}  {escape(check.name)}: {escape(check.detail)}", highlight=False, soft_wrap=True)
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
    for col in ("name", "summary", "GPUs", "programs (baselines, seed)", "bench shapes (4 GPUs)"):
        table.add_column(col)
    for name, wl in registry().items():
        programs = f"{', '.join(wl.baselines)}; {wl.seed}"
        labels = [s.label for s in wl.bench_shapes(max(wl.world_sizes))]
        shapes = ", ".join(labels[:6]) + (f", … ({len(labels)} in all)" if len(labels) > 6 else "")
        table.add_row(name, wl.summary, ", ".join(map(str, wl.world_sizes)), programs, shapes)
    console.print(table)


def _cell(timing: Any) -> str:
    if timing is None:
        return "-"
    if timing.verdict.ok and timing.median_us is not None:
        return f"{timing.median_us:,.1f}"
    return f"[red]{timing.verdict.failure}[/]"


def _ratio(numerator: Any, denominator: Any) -> float | None:
    ok = all(t is not None and t.verdict.ok and t.median_us for t in (numerator, denominator))
    return numerator.median_us / denominator.median_us if ok else None


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
) -> None:
    """Check and time a workload's baselines and our program side by side, against the floor."""
    from rich.progress import Progress

    from commweave.evaluate.evaluator import Evaluator
    from commweave.evaluate.floor import calibrate
    from commweave.report.results import write_results
    from commweave.runtime import PoolStartError, WorkerPool
    from commweave.workloads import get_workload

    try:
        wl = get_workload(workload)
        wl.check_world_size(gpus)
        texts = [t for item in shapes or [] for t in item.split(",") if t]
        chosen = [wl.parse_shape(text, gpus) for text in texts] if texts else wl.bench_shapes(gpus)
    except (KeyError, ValueError) as exc:
        _fail(str(exc).strip("'\""))
    if candidate is not None and not candidate.is_file():
        _fail(f"--candidate {candidate}: no such file")
    ours_text = candidate.read_text() if candidate is not None else wl.program_text(wl.seed)
    programs = {name: wl.program_text(name) for name in wl.baselines} | {"ours": ours_text}
    yardsticks = {name: wl.yardstick_text(name) for name in wl.yardsticks}  # timed, never checked
    _require_gpus(gpus, f"bench {workload} --gpus {gpus}")

    rows: list[dict[str, Any]] = []
    try:
        with WorkerPool(gpus, job_timeout_s=job_timeout) as pool, Progress(console=console, transient=True) as progress:
            task = progress.add_task("calibrating matmul, NVLink and HBM rates", total=1 + len(chosen) * 2)
            rates = calibrate(pool)
            evaluator = Evaluator(pool, wl, seeds=seeds, warmup=warmup, iters=iters, rates=rates,
                                  job_timeout_s=job_timeout)
            progress.advance(task)
            # Small awkward shapes once per program, then each timed shape itself.
            small = {name: evaluator.check(text, wl.check_shapes(gpus)) for name, text in programs.items()}
            for shape in chosen:
                progress.update(task, description=f"{shape}: correctness")
                verdicts = {name: evaluator.check(text, [shape]) if small[name].ok else small[name]
                            for name, text in programs.items()}
                progress.update(task, advance=1, description=f"{shape}: timing")
                runnable = {n: t for n, t in programs.items() if verdicts[n].ok}
                result = evaluator.benchmark(runnable | yardsticks, shape) if runnable else None
                progress.advance(task)
                rows.append({"shape": shape.label, "verdicts": {n: asdict(v) for n, v in verdicts.items()},
                             "bench": asdict(result) if result else None, "_timings": result.programs if result else {},
                             "_verdicts": verdicts, "floor_us": result.floor_us if result else None,
                             "comm_bytes": wl.cost(shape, gpus).comm_bytes})
    except PoolStartError as exc:
        _fail(str(exc))

    table = Table(title=f"{workload} on {gpus} GPUs (median of per-iteration max over ranks, µs)")
    table.add_column("shape")
    for name in programs:
        table.add_column(name, justify="right")
    for name in yardsticks:
        table.add_column(f"{name} (yardstick)", justify="right")
    for name in wl.baselines:
        table.add_column(f"ours vs {name}", justify="right")
    for name in yardsticks:
        table.add_column(f"{name}/ours", justify="right")
    table.add_column("floor", justify="right")
    table.add_column("floor/ours", justify="right")
    for row in rows:
        timings, verdicts = row.pop("_timings"), row.pop("_verdicts")
        cells = [_cell(timings.get(n)) if verdicts[n].ok else f"[red]{verdicts[n].failure}[/]" for n in programs]
        speedups = [_ratio(timings.get(b), timings.get("ours")) for b in wl.baselines]
        ours = timings.get("ours")
        yard_us = {n: timings[n].median_us if n in timings and timings[n].median_us else None for n in yardsticks}
        yard_cells = [f"{t:,.1f}" if t else "-" for t in yard_us.values()]
        fractions = {n: t / ours.median_us if t and ours is not None and ours.verdict.ok and ours.median_us else None
                     for n, t in yard_us.items()}
        row["yardsticks"] = {n: {"median_us": yard_us[n], "of_ours": fractions[n]} for n in yardsticks}
        for n in wl.comm_yardsticks:
            row["yardsticks"][n]["GBps"] = row["comm_bytes"] / yard_us[n] / 1e3 if yard_us[n] else None
        efficiency = row["floor_us"] / ours.median_us if ours is not None and ours.verdict.ok and ours.median_us else None
        row["speedup"] = dict(zip(wl.baselines, speedups))
        table.add_row(row["shape"], *cells, *yard_cells, *[f"{x:.2f}x" if x else "-" for x in speedups],
                      *[f"{x:.3f}" if x else "-" for x in fractions.values()],
                      f"{row['floor_us']:,.1f}" if row["floor_us"] else "-", f"{efficiency:.2f}" if efficiency else "-")
    payload = {"workload": workload, "gpus": gpus, "iters": iters, "warmup": warmup, "seeds": seeds,
               "rates": asdict(rates), "programs": list(programs), "yardsticks": {n: list(wl.yardsticks[n]) for n in yardsticks},
               "candidate": str(candidate) if candidate else None,
               "rows": rows}
    path = write_results(f"bench-{workload}-{gpus}gpu", payload, out_dir=out_dir)
    console.print(table)
    if yardsticks:
        console.print(f"yardsticks ({', '.join(yardsticks)}): timed in the same job, not checked (see the workload's yardsticks)")
    for row in rows:
        for n in wl.comm_yardsticks:
            gbps = row["yardsticks"][n]["GBps"]
            if gbps:
                console.print(f"{row['shape']}: {n} moves the slowest rank's {row['comm_bytes'] / 2**20:,.1f} MiB at "
                              f"{gbps:,.0f} GB/s, {gbps * 1e9 / rates.link_bytes_per_s:.2f} of the measured peer-copy "
                              f"rate ({rates.link_bytes_per_s / 1e9:,.0f} GB/s)", highlight=False)
    for row in rows:
        held = {n: t["memory_bytes"] for n, t in (row["bench"] or {}).get("programs", {}).items() if t.get("memory_bytes") is not None}
        if held:
            console.print(f"{row['shape']}: device memory per GPU beyond inputs and output (MiB): "
                          + ", ".join(f"{n} {b / 2**20:,.0f}" for n, b in held.items()), highlight=False)
    for row in rows:
        for name, verdict in row["verdicts"].items():
            if not verdict["ok"]:
                console.print(f"{row['shape']} {name}: {verdict['failure']}: {verdict['message']}", highlight=False)
    console.print(f"results: {path}")


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

    from commweave.evaluate.evaluator import Evaluator
    from commweave.evaluate.floor import calibrate
    from commweave.contracts.verdict import EvaluationError
    from commweave.llm import ModelConfig, client_for, load_models, resolve_model
    from commweave.runtime import PoolStartError, WorkerPool
    from commweave.search import Budget, SearchConfig
    from commweave.search.driver import evolve as drive, new_run_path, run_meta, template_for
    from commweave.space import Capabilities
    from commweave.workloads import get_workload

    try:
        meta: dict[str, Any] = {}
        if resume is not None:
            meta = run_meta(resume)
            if meta["workload"] != workload:
                raise ValueError(f"{resume} is a run of {meta['workload']!r}, not {workload!r}")
            gpus, shape, islands, seed = meta["gpus"], meta["shape"], meta["islands"], meta.get("seed", seed)
            run_budget = Budget(**meta["budget"])
        else:
            run_budget = Budget.parse(budget)
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
            stop_after_s = Budget.parse(stop_after).seconds
            if stop_after_s is None:
                raise ValueError(f"--stop-after {stop_after!r} must be a time (9m, 540s), not a number of evaluations")
        wl = get_workload(workload)
        wl.check_world_size(gpus)
        template = template_for(wl)
        chosen = wl.parse_shape(shape, gpus) if shape else template.default_shape(gpus)
    except (KeyError, ValueError, LookupError, FileNotFoundError, ImportError) as exc:
        _fail(str(exc).strip("'\"") if isinstance(exc, KeyError) else str(exc))  # KeyError's str() is a repr
    _require_gpus(gpus, f"evolve {workload} --gpus {gpus}")
    path = resume if resume is not None else new_run_path(workload, gpus, runs_dir)
    console.print(f"run: {path} ({chosen}, {gpus} GPUs, budget {run_budget.to_dict()})", highlight=False)
    if models:
        cap = f"${llm_budget:g}" if llm_budget is not None else "the run's" if resume is not None else "no cap"
        console.print(f"LLM islands: {llm_islands} of {islands} ({', '.join(m.name for m in models)}; budget {cap})",
                      highlight=False)
    config = SearchConfig(islands=islands, compile_workers=compile_workers, seed=seed, llm_islands=llm_islands)
    try:
        with WorkerPool(gpus, job_timeout_s=job_timeout) as pool:
            rates = calibrate(pool)
            probe = pool.run("commweave.runtime.selftest:probe")
            capabilities = Capabilities.from_probe(probe.values[0]) if probe.ok else \
                Capabilities(False, f"probe failed: {probe.first_failure()}")
            info = probe.values[0] if probe.ok else {}
            hardware = {"GPUs": gpus, **{label: info[key] for key, label in (("gpu", "GPU"), ("nccl_loaded", "NCCL"),
                                                                            ("lsa_size", "LSA (NVLink) team size"))
                                         if key in info}}
            evaluator = Evaluator(pool, wl, seeds=seeds, warmup=warmup, iters=iters, rates=rates, job_timeout_s=job_timeout)
            columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
            with Progress(*columns, console=console) as progress:
                best, count, paused = drive(path, template, evaluator, chosen, gpus, run_budget, config, rates=rates,
                                            capabilities=capabilities, progress=progress,
                                            stop_after_s=stop_after_s, llm_models=models, llm_budget_usd=llm_budget,
                                            hardware=hardware)
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
    from commweave.workloads import Workload, get_workload

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
