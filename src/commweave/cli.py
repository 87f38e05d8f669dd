"""The `commweave` command: doctor, list, demo, bench, evolve, report, export, agent fast-path.

Every user error (a bad argument, an unusable input file, an output path that cannot be written,
too few GPUs) is one line on stderr and exit status 2, said before anything is written, started or
paid for.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from commweave.runtime.confine import apply_safe_env
from commweave.report.results import RESULTS_DIR

# the click that typer's commands are made of: its own copy (typer >= 0.26) or the click package
_click_errors = sys.modules[TyperGroup.__mro__[1].__module__.rsplit(".", 1)[0] + ".exceptions"]


class _OneLineErrors(TyperGroup):
    """Click's usage errors (an unknown option, a value out of range) as one line on stderr and
    exit 2, like every other user error, instead of a usage panel."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except _click_errors.ClickException as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # click >= 8.2: the help, as click prints it
                typer.echo(exc.format_message())
                sys.exit(exc.exit_code)
            hint = f" (see {exc.ctx.command_path} --help)" if getattr(exc, "ctx", None) else ""
            _say_error(" ".join(exc.format_message().split()) + hint)
            sys.exit(exc.exit_code)
        except typer.Abort:
            _say_error("aborted")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


class _Console(Console):
    """rich's Console, with lines never wrapped (a path or a command stays whole, to be copied) and,
    when stdout is no terminal (a pipe, a file) and COLUMNS is unset, `PIPED_WIDTH` columns instead
    of rich's 80, so tables come out at their full width instead of cut ("unavai…")."""

    PIPED_WIDTH = 1000

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        if self._width is None and not self.is_terminal and "COLUMNS" not in os.environ:
            return ConsoleDimensions(self.PIPED_WIDTH, size.height)
        return size


app = typer.Typer(cls=_OneLineErrors, add_completion=False, no_args_is_help=True,
                  help="Co-design computation and communication on multi-GPU machines.")
console = _Console(soft_wrap=True)


@app.callback()
def _safe_environment() -> None:
    """NVLink multicast stays off in this process and every worker it starts; SIGTERM (a scheduler,
    `timeout`, `kill`) interrupts like Ctrl-C, so worker pools are torn down and their folders
    removed instead of left behind."""
    apply_safe_env()
    if threading.current_thread() is threading.main_thread():  # only there can Python take a signal
        signal.signal(signal.SIGTERM, signal.default_int_handler)


def _say_error(message: str) -> None:
    """`error: message` on stderr, never wrapped (one line at any terminal width)."""
    Console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def _fail(message: str, code: int = 2) -> None:
    """One clear line on stderr, then a non-zero exit."""
    _say_error(message)
    raise typer.Exit(code)


def _default_gpus(wl: Any, device: str = "cuda") -> int:
    """A workload's world size for this machine: the largest it runs at with the GPUs present, else
    its smallest (which `_require_gpus` then refuses, saying what can run instead). On CPU workers
    (bench and fast-path --device cpu), its smallest."""
    from commweave.runtime.capabilities import cuda_device_count

    fits = [w for w in wl.world_sizes if w <= cuda_device_count()] if device == "cuda" else []
    return max(fits) if fits else min(wl.world_sizes)


def _require_gpus(n: int, what: str, cpu_option: bool = False) -> None:
    """Fail unless this machine has `n` CUDA GPUs, naming what can run here instead."""
    from commweave.runtime.capabilities import cuda_device_count
    from commweave.workloads import registry

    have = cuda_device_count()
    if have >= n:
        return
    instead = ["`commweave demo` (a simulated search, any machine)"]
    if cpu_option:
        instead.append("--device cpu (a dry run on CPU workers)")
    fitting = sorted(name for name, wl in registry().items() if min(wl.world_sizes) <= have)
    if fitting:
        instead.append(f"a workload that runs on {have} GPU{'s' * (have != 1)} ({', '.join(fitting)})")
    _fail(f"{what} needs {n} CUDA GPU{'s' * (n != 1)}; this machine has {have}. Here you can run: {'; '.join(instead)}.")


def _check_writable(path: Path, what: str, *, folder: bool = False, new_folders: bool = False) -> None:
    """ValueError unless `path` (a file, or a `folder` to be written with any missing parent
    folders) can be written: an existing path must be of that kind and writable, and its nearest
    existing ancestor a folder where a file can really be made (tried: /proc and /sys pass
    os.access for root). A file's folder must exist unless `new_folders` (a default path the
    command makes), so no folder appears that the user did not ask for. Called before any work, so
    a bad --out costs nothing."""
    path = Path(path).absolute()
    if path.exists():
        if path.is_dir() != folder:
            raise ValueError(f"{what} {path} is a {'file' if folder else 'folder'}, not a {'folder' if folder else 'file'}")
        if not os.access(path, os.W_OK):
            raise ValueError(f"{what} {path} is not writable")
        _try_writing(path if folder else path.parent, f"{what} {path} is not writable")
        return
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{what} {path} cannot be created: {parent} is a file, not a folder")
    if not folder and not new_folders and parent != path.parent:
        raise ValueError(f"{what} {path} cannot be created: folder {path.parent} does not exist (create it first)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {path} cannot be created: folder {parent} is not writable")
    _try_writing(parent, f"{what} {path} cannot be created in {parent}")


def _try_writing(folder: Path, message: str) -> None:
    """ValueError(`message` and the system's reason) unless a file can be made in `folder` (one is
    made and removed at once)."""
    import tempfile

    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".commweave-probe-"):
            pass
    except OSError as exc:
        raise ValueError(f"{message} ({exc.strerror or exc})") from None


def _check_candidate(path: Path) -> str:
    """The text of a program file given as --candidate: it exists and parses as a program (setup()
    and run() defined, EVOLVE-BLOCK markers); else a ValueError naming the file."""
    from commweave.contracts.program import parse_program

    if not path.is_file():
        raise ValueError(f"--candidate {path}: no such file")
    try:
        text = path.read_text()
        parse_program(text)
    except ValueError as exc:  # ProgramError, or UnicodeDecodeError for a binary file
        raise ValueError(f"--candidate {path}: {exc}") from None
    return text


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

    table = Table(title="workloads", show_lines=True)
    table.add_column("name", no_wrap=True)  # a name is what a user types: never cut
    table.add_column("GPUs", no_wrap=True)
    table.add_column("what it computes; its programs (baselines; seed); bench shapes", overflow="fold")
    for name, wl in registry().items():
        labels = [s.label for s in wl.bench_shapes(max(wl.world_sizes))]
        shapes = ", ".join(labels[:6]) + (f", … ({len(labels)} in all)" if len(labels) > 6 else "")
        table.add_row(name, ", ".join(map(str, wl.world_sizes)),
                      f"{wl.summary}\nprograms: {', '.join(wl.baselines)}; {wl.seed}\n"
                      f"shapes ({max(wl.world_sizes)} GPUs): {shapes}")
    console.print(table)


@app.command()
def demo(
    out: Path = typer.Option(None, "--out", help="folder for the run database, its report and the best program "
                             "(default: runs/demo-<time>)"),
    budget: int = typer.Option(150, "--budget", min=1, help="evaluations"),
    workload: str = typer.Option("gemm-allgather", "--workload", help="a workload with a template (see `commweave list`)"),
    gpus: int = typer.Option(4, "--gpus", min=1, help="the world size the simulated runs pretend to have"),
    seed: int = typer.Option(0, "--seed", help="random seed of the search"),
) -> None:
    """Try commweave on any machine, GPUs or not: a whole search, its report and its best program.

    The real search, database, report and export, with a simulated evaluator (a known fitness landscape over the workload's directive space)
    instead of compiling and timing programs. Everything it writes says "simulated"."""
    import datetime as dt
    import time

    from commweave.report.html import write_report
    from commweave.search import Budget, Evolution, ProgramDB, SearchConfig
    from commweave.search.simulate import demo_evaluator

    if out is None:
        out = Path("runs") / f"demo-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%dT%H%M%SZ')}"
    try:
        _check_writable(out, "--out", folder=True)
        wl = _workload_named(workload)
        wl.check_world_size(gpus)
        template = wl.template()
    except (KeyError, ValueError, LookupError) as exc:
        _fail(str(exc).strip("'\"") if isinstance(exc, KeyError) else str(exc))
    path = out / "demo.sqlite"
    if path.exists():
        _fail(f"--out {out} already holds a demo run ({path}): give another folder")
    shape = template.default_shape(gpus)
    started = time.monotonic()
    with console.status(f"simulated search: {budget} evaluations of {wl.name} programs at {shape}"), \
            ProgramDB(path) as db:
        search = Evolution(db, template, demo_evaluator(template, gpus, seed), shape, gpus,
                           Budget(evaluations=budget), SearchConfig(islands=4, seed=seed))
        db.set_meta(simulated=True)
        best = search.run()
        count = db.count()
    console.print(f"simulated search: {count} evaluations in {time.monotonic() - started:.1f} s; best "
                  f"{best.fitness:.2f}x (simulated) over the simulated baseline" if best else
                  f"simulated search: {count} evaluations, none correct", highlight=False)
    console.print(f"run (simulated): {path}", highlight=False)
    console.print(f"report (simulated): {write_report(path)}", highlight=False)
    if best is not None:
        console.print(_export_best(path, out / "best.py"), highlight=False)
    console.print("Nothing here ran on a GPU. On a GPU machine: commweave bench WORKLOAD, then commweave evolve "
                  "WORKLOAD.", highlight=False)


@app.command()
def bench(
    workload: str = typer.Argument(..., help="workload name (see `commweave list`)"),
    gpus: int = typer.Option(None, "--gpus", min=1, help="GPUs (one worker each; default: the most this machine and the workload allow)"),
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

    if device not in ("cuda", "cpu"):
        _fail(f"--device must be cuda or cpu, not {device!r}")
    try:
        wl = _workload_named(workload)
        gpus = gpus or _default_gpus(wl, device)
        wl.check_world_size(gpus)
        texts = [t for item in shapes or [] for t in item.split(",") if t]
        chosen = [wl.parse_shape(text, gpus) for text in texts] if texts else wl.bench_shapes(gpus)
        ours_text = _check_candidate(candidate) if candidate is not None else wl.program_text(wl.seed)
        programs = {name: wl.program_text(name) for name in wl.baselines} | {"ours": ours_text}
        _check_writable(out_dir, "--out-dir", folder=True)
    except (KeyError, ValueError) as exc:
        _fail(str(exc).strip("'\"") if isinstance(exc, KeyError) else str(exc))  # KeyError's str() is a repr
    if device == "cuda":
        _require_gpus(gpus, f"bench {workload} --gpus {gpus}", cpu_option=True)
    try:
        with WorkerPool(gpus, device=device, job_timeout_s=job_timeout) as pool, \
                Progress(console=console, transient=True) as progress:
            task = progress.add_task("starting", total=None)

            def show(step: BenchStep) -> None:
                progress.update(task, description=step.description, completed=step.done, total=step.total)

            report = bench_workload(pool, wl, chosen, programs, yardsticks=list(wl.yardsticks), iters=iters,
                                    warmup=warmup, seeds=seeds, job_timeout_s=job_timeout,
                                    meta={"candidate": str(candidate) if candidate else None}, progress=show)
            trained = _train_steps(pool, wl.name, chosen, iters, warmup, device, out_dir)
    except (PoolStartError, EvaluationError) as exc:
        _fail(str(exc))
    path = write_results(f"bench-{wl.name}-{gpus}gpu", report.to_json(), out_dir=out_dir,
                         provenance=report.provenance)
    console.print(comparison_table(report))
    for line in notes(report):
        console.print(line, highlight=False, markup=False)
    console.print(f"results: {path}", highlight=False)
    if trained is not None:
        console.print(trained[0])
        console.print(f"training results: {trained[1]}", highlight=False)


def _train_steps(pool: Any, workload: str, shapes: list, iters: int, warmup: int, device: str,
                 out_dir: Path) -> tuple[Table, Path] | None:
    """A workload with a backward: its training step timed per shape (`commweave.ops.train_bench`),
    as a table and the JSON written; None for the others."""
    from commweave.contracts.verdict import EvaluationError
    from commweave.ops.train_bench import STEPS
    from commweave.report.results import write_results
    from commweave.report.train import train_rows, train_table

    if workload not in STEPS:
        return None
    per_shape = {}
    for shape in shapes:
        result = pool.run(STEPS[workload], shape_text=shape.label, iters=iters, warmup=warmup)
        if not result.ok:
            raise EvaluationError(f"the training step of {workload} on {shape.label} failed: {result.first_failure()}")
        per_shape[shape.label] = result.values
    rows = train_rows(per_shape, on_gpus=device == "cuda")
    path = write_results(f"bench-train-{workload}-{pool.world_size}gpu", {"rows": rows}, out_dir=out_dir)
    return train_table(rows), path


# -- the slow path: evolve, report, export -------------------------------------------------------
@app.command()
def evolve(
    workload: str = typer.Argument(None, help="workload name (see `commweave list`), or give --problem"),
    gpus: int = typer.Option(None, "--gpus", min=1, help="GPUs (one worker each; default: the most this machine and the workload allow)"),
    budget: str = typer.Option("200", "--budget", help="evaluations (200) or wall time (20m, 90s, 1h)"),
    shape: str = typer.Option(None, "--shape", help="the shape to optimise (default: the template's, 8192^3 for gemm-allgather)"),
    pool_gpus: int = typer.Option(None, "--pool-gpus", min=1, help="split this node's GPUs into pools of this many "
                                  "(the world size; replaces --gpus), one candidate in flight per pool"),
    cluster: str = typer.Option(None, "--cluster", help="evaluate on a Ray cluster: 'auto' or its address; one pool "
                                "(a Ray actor) per --gpus GPUs of the cluster (needs commweave\\[cluster])"),
    islands: int = typer.Option(4, "--islands", min=1),
    seed: int = typer.Option(0, "--seed", help="random seed of the search"),
    resume: Path = typer.Option(None, "--resume", help="a run database to continue (its workload, shape, GPUs and budget)"),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="where a new run's database goes"),
    iters: int = typer.Option(None, "--iters", min=1, help="timed batches per program of each candidate "
                              "(default 10; each >= 12 ms on GPUs)"),
    warmup: int = typer.Option(None, "--warmup", min=1, help="warm-up batches (default 3)"),
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
    problem: Path = typer.Option(None, "--problem", help="a problem file or ParallelKernelBench reference: its "
                                 "reference is traced and bound to the template of a known pattern (replaces WORKLOAD)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="no GPU: the search (and --problem's binding, traced on CPU "
                                 "ranks) with `commweave demo`'s simulated judge instead of compiling and timing "
                                 "programs; everything it writes says simulated"),
) -> None:
    """Search the workload's directive space and template knobs on this machine's GPUs.

    Offline proposer by default; with --llm, some islands ask a model for code-level changes instead.
    Every evaluated program (and every LLM call) goes to one SQLite file per run; --resume
    continues a run killed at any moment."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from commweave.contracts.verdict import EvaluationError
    from commweave.runtime import PoolStartError, WorkerPool
    from commweave.runtime.capabilities import cuda_device_count
    from commweave.search.driver import SEARCH_ITERS, SEARCH_WARMUP, plan_run, run_meta, run_on_cluster, run_on_pools
    from commweave.search.pools import split_gpus

    if (workload is None) == (problem is None):
        _fail("give a workload (see `commweave list`) or --problem PROBLEM, one of them")
    if dry_run and (cluster is not None or pool_gpus is not None or llm):
        _fail("--dry-run runs here with a simulated judge and no LLM: leave out --cluster, --pool-gpus and --llm")
    if problem is not None:
        bound_at = pool_gpus or gpus or 2
        workload, shape = _bound_workload(problem, shape, bound_at)
        if dry_run and gpus is None:
            gpus = bound_at
    if pool_gpus is not None and cluster is not None:
        _fail("--pool-gpus splits this node's GPUs and --cluster uses a Ray cluster's: give one of them")
    if cluster is not None:
        try:
            from commweave.search.ray_pools import import_ray

            import_ray()
        except ImportError as exc:
            _fail(str(exc))
    try:
        if resume is None:
            _check_writable(runs_dir, "--runs-dir", folder=True)
        if gpus is None and pool_gpus is None and resume is None:
            gpus = _default_gpus(_workload_named(workload), "cpu" if dry_run else "cuda")
        plan = plan_run(workload, gpus=pool_gpus or gpus or 0, budget=budget, shape=shape, islands=islands, seed=seed,
                        resume=resume, runs_dir=runs_dir, compile_workers=compile_workers, llm=llm or (),
                        llm_config=llm_config, llm_budget=llm_budget, llm_islands=llm_islands, stop_after=stop_after)
        if resume is not None:
            _check_writable(resume, "--resume")  # the search goes on writing into it
            if bool(run_meta(resume).get("simulated")) != dry_run:
                _fail(f"--resume {resume}: {'a dry run (simulated judge): resume it with --dry-run' if not dry_run else 'a run on GPUs: resume it without --dry-run'}")
    except (KeyError, ValueError, LookupError, FileNotFoundError, ImportError) as exc:
        _fail(str(exc).strip("'\"") if isinstance(exc, KeyError) else str(exc))  # KeyError's str() is a repr
    if dry_run:
        _simulated_search(plan)
        return
    devices = [list(range(plan.gpus))]
    if cluster is None:
        _require_gpus(plan.gpus, f"evolve {workload} --gpus {plan.gpus}")
        if pool_gpus is not None:
            devices = split_gpus(cuda_device_count(), plan.gpus)
    path, models = plan.path, plan.models
    console.print(f"run: {path} ({plan.shape}, {plan.gpus} GPUs, budget {plan.budget.to_dict()})", highlight=False)
    if plan.gpus == 1:
        varied = ", ".join(d.removeprefix("knob:") for d in plan.template.one_gpu_dimensions) or "nothing (one program)"
        console.print(f"1 GPU: nothing to communicate, so no communication is timed; the search varies what changes "
                      f"the compute side: {varied}", highlight=False)
    if models:
        cap = f"${plan.llm_budget_usd:g}" if plan.llm_budget_usd is not None else "the run's" if plan.resumed else "no cap"
        console.print(f"LLM islands: {plan.config.llm_islands} of {plan.config.islands} "
                      f"({', '.join(m.name for m in models)}; budget {cap})", highlight=False)
    evaluation = dict(iters=SEARCH_ITERS if iters is None else iters, warmup=SEARCH_WARMUP if warmup is None else warmup,
                      seeds=seeds, job_timeout_s=job_timeout)
    try:
        with ExitStack() as stack:
            progress = stack.enter_context(Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                                                    console=console))
            if cluster is not None:
                best, count, paused = run_on_cluster(plan, cluster, progress=progress, **evaluation)
            else:
                from commweave.runtime.confine import RUN_PATHS_ENV

                run_dir = str(path.resolve().parent)  # the run's database: never readable by a candidate
                pools = [stack.enter_context(WorkerPool(plan.gpus, job_timeout_s=job_timeout,
                                                        env={"CUDA_VISIBLE_DEVICES": ",".join(map(str, group)),
                                                             RUN_PATHS_ENV: run_dir}))
                         for group in devices]
                labels = [f"GPUs {','.join(map(str, group))}" for group in devices]
                best, count, paused = run_on_pools(plan, pools, progress=progress, labels=labels, **evaluation)
    except ValueError as exc:
        _fail(f"{exc} (every evaluated program is in {path}; continue with --resume {path})")
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
    run: Path = typer.Argument(..., help="a run database written by `commweave evolve` or `commweave demo`"),
    out: Path = typer.Option(None, "--out", help="output folder (default: beside the database, <name>-report)"),
) -> None:
    """One self-contained HTML page for a run (plots embedded), with the plots as PNGs beside it."""
    from commweave.report.html import report_dir, write_report

    try:
        _check_writable(report_dir(run, out), "--out", folder=True)
        page = write_report(run, out)
    except (FileNotFoundError, ValueError) as exc:
        _fail(str(exc))
    console.print(f"report: {page}", highlight=False)


def _export_best(run: Path, out: Path) -> str:
    """Write the run's best program to `out` (see `export`) and say what was written; a ValueError
    (FileNotFoundError) if `run` is not a run database or holds no correct program."""
    from commweave.ops.exported import export_text
    from commweave.search.db import ProgramDB
    from commweave.search.driver import run_meta

    meta = run_meta(run)
    with ProgramDB(run, readonly=True) as db:
        best = db.best()
    if best is None:
        raise ValueError(f"run {run} has no correct program to export")
    simulated = {"simulated": True} if meta.get("simulated") else {}
    out.write_text(export_text(best.code, meta["workload"], run=run.name, program_id=best.id,
                               fitness=round(best.fitness, 4), baseline=best.timings.get("baseline"),
                               shape=meta.get("shape"), gpus=meta.get("gpus"), **simulated))
    what = "simulated " if simulated else ""
    return (f"program #{best.id} ({what}{best.fitness:.2f}x over {best.timings.get('baseline')} on {meta.get('shape')}) "
            f"-> {out}. Time it: commweave bench {meta['workload']} --gpus {meta['gpus']} --candidate {out}; "
            f"use it from PyTorch: commweave.ops.load({str(out)!r})")


@app.command()
def export(
    run: Path = typer.Argument(..., help="a run database written by `commweave evolve` or `commweave demo`"),
    out: Path = typer.Option(..., "--out", help="file to write the best program to"),
) -> None:
    """Write a run's best program to a file, loadable as a PyTorch op.

    The program text (its directive set in the first line) plus a line naming its workload, so it
    loads as a PyTorch op with `commweave.ops.load(FILE)`. Time it beside the baselines with
    `commweave bench WORKLOAD --candidate FILE`."""
    try:
        if out.resolve() == run.resolve():
            raise ValueError(f"--out {out} is the run database itself")
        _check_writable(out, "--out")
        said = _export_best(run, out)
    except (FileNotFoundError, ValueError) as exc:
        _fail(str(exc))
    console.print(said, highlight=False)


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
    gpus: int = typer.Option(None, "--gpus", min=1, help="GPUs (one worker each; default: the most this machine and the workload allow)"),
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
    """Convert a host-driven program into a device-initiated one.

    Stage A adds symmetric buffers, windows and a device communicator while keeping the host collectives; stage B replaces them
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
        gpus = gpus or _default_gpus(wl, device)
        wl.check_world_size(gpus)
        default_out = out is None
        if default_out:
            stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
            out = Path("runs") / f"fast-path-{wl.name}-{gpus}gpu-{stamp}.py"
        _check_writable(out, "--out", new_folders=default_out)
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
        _require_gpus(gpus, f"agent fast-path --gpus {gpus}", cpu_option=True)

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


def _problem_options(shape: str | None, dtype: str | None) -> dict[str, Any]:
    """load_problem's options from --shape MxN and --dtype (a ValueError names a bad one)."""
    options: dict[str, Any] = {"dtype": dtype}
    if shape is not None:
        parts = shape.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shape must be MxN with positive integers (e.g. 1024x1024), got {shape!r}")
        options["base_shape"] = (int(parts[0]), int(parts[1]))
    return options


def _device_or_fail(device: str, gpus: int) -> None:
    from commweave.runtime.capabilities import cuda_device_count

    if device not in ("cpu", "cuda"):
        _fail(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda" and cuda_device_count() < gpus:
        _fail(f"--gpus {gpus} needs {gpus} GPUs; this machine has {cuda_device_count()} (try --device cpu)")


@app.command()
def judge(
    problem: Path = typer.Argument(..., help="a problem file (docs/problems.md) or a ParallelKernelBench reference "
                                   "inside its checkout (<pkb>/reference/<id>_<name>.py)"),
    solution: Path = typer.Argument(..., help="a file defining the same solution(...)"),
    gpus: int = typer.Option(2, "--gpus", min=1, help="ranks (GPUs, or CPU processes with --device cpu)"),
    device: str = typer.Option("cuda", "--device", help="cuda, or cpu (gloo)"),
    shape: str = typer.Option(None, "--shape", help="PKB problems: the base shape MxN (default 1024x1024)"),
    dtype: str = typer.Option(None, "--dtype", help="PKB problems: float32, bfloat16, float16 (default bfloat16)"),
    trials: int = typer.Option(5, "--trials", min=2, help="fresh random trials of the correctness check"),
    iters: int = typer.Option(30, "--iters", min=1, help="timed iterations of each program"),
    warmup: int = typer.Option(10, "--warmup", min=0),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Judge SOLUTION against PROBLEM's reference on fresh random trials per rank, then time both."""
    import json

    from commweave.contracts.verdict import EvaluationError, InfrastructureError
    from commweave.problems.format import ProblemError, check_solution_file, load_problem
    from commweave.problems.judge import Unsupported, host_bound, judge as judge_solution
    from commweave.runtime import PoolStartError, WorkerPool

    _device_or_fail(device, gpus)
    try:
        spec = load_problem(problem, **_problem_options(shape, dtype))
        text = check_solution_file(solution)
    except (ProblemError, ValueError) as exc:
        _fail(str(exc))
    try:
        with WorkerPool(gpus, device, job_timeout_s=600.0) as pool:
            verdict = judge_solution(pool, spec, text, trials=trials, warmup=warmup, iters=iters)
    except Unsupported as exc:
        _fail(f"problem {spec.name} cannot be judged here: {exc}")
    except (EvaluationError, InfrastructureError, PoolStartError) as exc:
        _fail(f"the judge could not reach a verdict: {str(exc).splitlines()[0]}", code=1)
    if as_json:
        print(json.dumps(verdict.fields()))
        return
    if verdict.ok:
        console.print(f"{spec.name}: correct on {trials} trials at {gpus} ranks; {verdict.speedup:.2f}x the reference "
                      f"({verdict.solution_us:,.1f} µs vs {verdict.reference_us:,.1f} µs)", highlight=False)
        late = host_bound(verdict.resolution)
        if late:
            console.print(f"warning: the GPU ran some timed batches of the {' and the '.join(late)} before they "
                          "were queued: those times show the host's pace (see docs/problems.md)", highlight=False)
    else:
        console.print(f"{spec.name}: wrong: {escape(verdict.failure or '')}", highlight=False)


def _simulated_search(plan: Any) -> None:
    """`evolve --dry-run`: the planned search (proposers, islands, database, resume) with demo's
    simulated judge; the run is marked simulated, so its report and export say so."""
    from commweave.search.driver import evolve as search
    from commweave.search.simulate import demo_evaluator

    console.print(f"dry run: {plan.path} ({plan.shape}, {plan.gpus} simulated GPUs, budget {plan.budget.to_dict()}); "
                  f"a simulated judge scores each program's directives, nothing is compiled or timed", highlight=False)
    with console.status("simulated search"):
        best, count, _ = search(plan.path, plan.template, demo_evaluator(plan.template, plan.gpus, plan.config.seed),
                                plan.shape, plan.gpus, plan.budget, plan.config, simulated=True)
    said = f"best: program #{best.id}, {best.fitness:.2f}x (simulated)" if best else "none correct"
    console.print(f"dry run: {count} evaluated; {said}. Next: commweave report {plan.path}; on GPUs: the same "
                  f"command without --dry-run", highlight=False)


def _bound_workload(problem: Path, shape: str | None, world_size: int) -> tuple[str, str | None]:
    """(workload, shape) `evolve --problem` searches: the problem's reference traced on CPU ranks
    and bound to a template (agents.problem_binding); one line and exit 2 when it cannot be."""
    from commweave.agents.problem_binding import Unbound, bind_problem
    from commweave.problems.format import ProblemError, load_problem
    from commweave.problems.service import ReferenceError

    try:
        binding = bind_problem(load_problem(problem), world_size, "cpu")
    except (ProblemError, Unbound, ReferenceError) as exc:
        _fail(f"{problem}: cannot be searched: {exc}")
    console.print(f"{problem.name}: {binding.pattern} -> template {binding.workload}"
                  f"{' at ' + binding.shape if binding.shape else ''}", highlight=False)
    return binding.workload, shape or binding.shape or None


problems_app = typer.Typer(no_args_is_help=True, help="Problems: PyTorch + torch.distributed programs as workloads.")
app.add_typer(problems_app, name="problems")


@problems_app.command("run")
def problems_run(
    source: str = typer.Argument(..., help="a folder of problem files, a ParallelKernelBench checkout, or 'pkb' "
                                 "(the checkout named by $COMMWEAVE_PKB)"),
    solutions: Path = typer.Option(None, "--solutions", help="a folder of solution files named like the problems "
                                   "(default: each reference judges itself)"),
    gpus: int = typer.Option(2, "--gpus", min=1),
    device: str = typer.Option("cuda", "--device", help="cuda, or cpu (gloo)"),
    shape: str = typer.Option(None, "--shape", help="PKB problems: the base shape MxN (default 1024x1024)"),
    dtype: str = typer.Option(None, "--dtype", help="PKB problems: float32, bfloat16, float16 (default bfloat16)"),
    only: str = typer.Option(None, "--only", help="comma-separated problem numbers or names to run, in that order"),
    trials: int = typer.Option(5, "--trials", min=2),
    iters: int = typer.Option(30, "--iters", min=1),
    warmup: int = typer.Option(10, "--warmup", min=0),
    out: Path = typer.Option(None, "--out", help="the HTML table (default: beside the JSON, problems-<name>-<device>-<stamp>.html)"),
    out_dir: Path = typer.Option(RESULTS_DIR, "--out-dir", help="where the results JSON goes"),
) -> None:
    """Every problem through the judge: one table (HTML, and JSON with provenance in bench/results),
    rewritten after each problem (until the last, `not_judged_yet` lists the rest)."""
    from commweave.problems.format import ProblemError, problems_in
    from commweave.problems.judge import host_bound
    from commweave.problems.suite import rows_json, run_problems, solution_for, summary
    from commweave.report.problems import write_table
    from commweave.report.results import write_results
    from commweave.runtime.provenance import Provenance

    _device_or_fail(device, gpus)
    folder = os.environ.get("COMMWEAVE_PKB", "") if source == "pkb" else source
    if not folder:
        _fail("'pkb' names the ParallelKernelBench checkout in $COMMWEAVE_PKB, which is not set")
    try:
        found = problems_in(Path(folder), **_problem_options(shape, dtype))
        if solutions is not None and not solutions.is_dir():
            raise ValueError(f"--solutions {solutions} is not a folder")
        _check_writable(out_dir, "--out-dir", folder=True)
    except (ProblemError, ValueError) as exc:
        _fail(str(exc))
    if only:  # in the order given (a run stopped at a deadline loses the last)
        by_key = {key: p for p in found for key in (p.name, p.name.split("_")[0])}
        wanted = list(dict.fromkeys(w.strip() for w in only.split(",") if w.strip()))
        unknown = [w for w in wanted if w not in by_key]
        if unknown or not wanted:
            _fail(f"--only: {', '.join(unknown) or repr(only)} matches no problem in {folder}")
        found = list(dict.fromkeys(by_key[w] for w in wanted))

    name = f"problems-{'pkb' if source == 'pkb' or (Path(folder) / 'reference').is_dir() else Path(folder).name}-{device}"
    origin = Provenance.now()  # one file, rewritten after every problem: a run stopped midway keeps what it judged
    queued = [p.name for p in found if solution_for(p, solutions) is not None]
    judged: list[Any] = []

    def record(rows: list[Any]) -> tuple[Path, Path, dict[str, Any]]:
        totals, table = summary(rows), rows_json(rows)
        payload = {"world_size": gpus, "device": device, "source": str(Path(folder).absolute()),
                   "solutions": str(solutions) if solutions else None, "summary": totals, "rows": table}
        if len(rows) < len(queued):
            payload["not_judged_yet"] = queued[len(rows):]
        results = write_results(name, payload, out_dir=out_dir, provenance=origin)
        return results, write_table(table, totals, f"{name}: {gpus} ranks", out or results.with_suffix(".html")), totals

    def progress(row: Any) -> None:
        speed = f"{row.speedup:.2f}x" if row.speedup is not None else "-"
        late = host_bound(row.resolution)
        speed += f" (host's pace in batches of the {' and the '.join(late)})" if late else ""
        console.print(f"{row.problem}: {row.cause} {speed} ({row.seconds:.0f} s) {escape(row.message)}", highlight=False)
        judged.append(row)
        record(judged)

    rows = run_problems(found, gpus, device, solutions, trials=trials, warmup=warmup, iters=iters, progress=progress)
    results, page, totals = record(rows)
    console.print(f"{totals['ok']} of {totals['problems']} correct, {totals['ok_in_band']} with speedup in "
                  f"{totals['band']}; failed by cause: {totals['failed_by_cause']}\nJSON: {results}\nHTML: {page}",
                  highlight=False)


@problems_app.command("bind")
def problems_bind(
    problem: Path = typer.Argument(..., help="a problem file, a ParallelKernelBench reference in its checkout, or a "
                                   "folder of either (one line each)"),
    gpus: int = typer.Option(2, "--gpus", min=1, help="ranks the reference is traced at"),
    device: str = typer.Option("cpu", "--device", help="where the reference is traced: cpu (gloo) or cuda"),
    shape: str = typer.Option(None, "--shape", help="PKB problems: the base shape MxN (default 1024x1024)"),
    dtype: str = typer.Option(None, "--dtype", help="PKB problems: float32, bfloat16, float16 (default bfloat16)"),
) -> None:
    """The offline fast path: trace the reference, recognise a known pattern, name the template
    (and shape) `commweave evolve` searches for it; one line when no pattern is known."""
    from commweave.agents.problem_binding import Binding, Unbound, bind_problem, bind_problems
    from commweave.problems.format import ProblemError, load_problem, problems_in
    from commweave.problems.service import ReferenceError

    _device_or_fail(device, gpus)
    try:
        if problem.is_dir():
            found = problems_in(problem, **_problem_options(shape, dtype))
            for name, outcome in bind_problems(found, gpus, device).items():
                what = (f"{outcome.pattern} -> template {outcome.workload} {outcome.shape}".rstrip()
                        if isinstance(outcome, Binding) else f"not bound: {outcome}")
                console.print(f"{name}: {escape(what)}", highlight=False)
            return
        spec = load_problem(problem, **_problem_options(shape, dtype))
        binding = bind_problem(spec, gpus, device)
    except (ProblemError, ValueError, ReferenceError) as exc:
        _fail(f"{problem}: {exc}" if isinstance(exc, (Unbound, ReferenceError)) else str(exc))
    at = f" --shape {binding.shape}" if binding.shape else ""
    console.print(f"{spec.name}: {binding.pattern} -> template {binding.workload}{at}; search it: commweave evolve "
                  f"--problem {problem} --gpus {gpus}", highlight=False)

if __name__ == "__main__":  # pragma: no cover
    app()
