"""Every user error of the `commweave` command is one line on stderr and exit status 2, and leaves
every file as it was: a folder's files (paths, sizes, mtimes) are compared before and after. Also:
`commweave list` reads at 80 columns."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

import commweave.cli as cli
from commweave.cli import app
from commweave.search import Budget, Evolution, ProgramDB, SearchConfig
from commweave.search.simulate import SimulatedEvaluator
from commweave.workloads import get_workload, registry

runner = CliRunner()
TEMPLATE = get_workload("gemm-allgather").template()
NO_RUN = '''"""A program without run()."""
# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {}
# EVOLVE-BLOCK-END
'''


@pytest.fixture(scope="module")
def run_db(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("errors") / "run.sqlite"
    ev = SimulatedEvaluator(TEMPLATE, 4, TEMPLATE.seed_directives().with_(comm_ctas=16))
    with ProgramDB(path) as db:
        Evolution(db, TEMPLATE, ev, TEMPLATE.default_shape(4), 4, Budget(evaluations=8), SearchConfig(islands=2)).run()
    return path


@pytest.fixture
def place(tmp_path, run_db, monkeypatch) -> Path:
    """A working folder (the current directory) holding a run, a text file, an empty file, a corrupt
    run, an SQLite file of another kind, a read-only folder and programs."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(run_db, tmp_path / "run.sqlite")
    (tmp_path / "notes.txt").write_text("not a database\n")
    (tmp_path / "empty.sqlite").write_bytes(b"")
    data = bytearray(run_db.read_bytes())
    assert len(data) > 6 * 4096
    data[2 * 4096:5 * 4096] = os.urandom(3 * 4096)  # pages past the header: the file still opens as SQLite
    (tmp_path / "corrupt.sqlite").write_bytes(bytes(data))
    other = ProgramDB(tmp_path / "other.sqlite")
    other.conn.execute("DROP TABLE run")
    other.close()
    for suffix in ("-wal", "-shm"):
        (tmp_path / f"other.sqlite{suffix}").unlink(missing_ok=True)
    (tmp_path / "locked").mkdir()
    (tmp_path / "locked").chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP)
    (tmp_path / "no_run.py").write_text(NO_RUN)
    (tmp_path / "broken.py").write_text("def run(:\n")
    (tmp_path / "host.py").write_text(get_workload("gemm-allgather").program_text("host"))
    if os.geteuid() == 0:  # root writes anywhere: answer as the kernel answers everyone else
        real = os.access
        monkeypatch.setattr(cli.os, "access", lambda p, mode: real(p, mode) and (
            Path(p).resolve() != (tmp_path / "locked").resolve() or not mode & os.W_OK))
    yield tmp_path
    (tmp_path / "locked").chmod(stat.S_IRWXU)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else (-1, 0)
            for p in sorted(root.rglob("*"))}


def user_error(root: Path, args: list[str], *words: str) -> str:
    """Run the command; assert exit 2, nothing on stdout, one line on stderr holding `words`, and
    no file under `root` created, removed or touched. Returns the line."""
    before = snapshot(root)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, (args, result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.stderr)
    assert result.stdout == "", (args, result.stdout)
    for word in words:
        assert word in lines[0], (args, lines[0], word)
    assert snapshot(root) == before, args
    return lines[0]


READ_ERRORS = [
    # report / export on files that are not run databases
    (["report", "notes.txt"], "notes.txt is not a commweave run database"),
    (["export", "notes.txt", "--out", "best.py"], "notes.txt is not a commweave run database"),
    (["report", "corrupt.sqlite"], "corrupt.sqlite is"),
    (["export", "corrupt.sqlite", "--out", "best.py"], "corrupt.sqlite is"),
    (["report", "empty.sqlite"], "empty.sqlite is not a commweave run database"),
    (["export", "empty.sqlite", "--out", "best.py"], "empty.sqlite is not a commweave run database"),
    (["report", "other.sqlite"], "other.sqlite is not a commweave run database (no run table)"),
    (["report", "missing.sqlite"], "no run database at missing.sqlite"),
    (["export", "missing.sqlite", "--out", "best.py"], "no run database at missing.sqlite"),
    (["evolve", "gemm-allgather", "--resume", "notes.txt"], "notes.txt is not a commweave run database"),
]
OUTPUT_ERRORS = [
    (["report", "run.sqlite", "--out", "locked/report"], "--out", "is not writable"),
    (["report", "run.sqlite", "--out", "notes.txt/report"], "notes.txt is a file, not a folder"),
    (["report", "run.sqlite", "--out", "notes.txt"], "is a file, not a folder"),
    (["export", "run.sqlite", "--out", "locked/best.py"], "--out", "is not writable"),
    (["export", "run.sqlite", "--out", "notes.txt/best.py"], "notes.txt is a file, not a folder"),
    (["export", "run.sqlite", "--out", "locked"], "is a folder, not a file"),
    (["export", "run.sqlite", "--out", "./run.sqlite"], "is the run database itself"),
    (["evolve", "gemm-allgather", "--runs-dir", "notes.txt/runs"], "--runs-dir", "notes.txt is a file"),
    (["evolve", "gemm-allgather", "--runs-dir", "locked"], "--runs-dir", "is not writable"),
    (["bench", "gemm-allgather", "--out-dir", "notes.txt/results"], "--out-dir", "notes.txt is a file"),
    (["bench", "gemm-allgather", "--device", "cpu", "--out-dir", "locked/r"], "--out-dir", "is not writable"),
    (["agent", "fast-path", "host.py", "--workload", "gemm-allgather", "--out", "notes.txt/x.py"],
     "--out", "notes.txt is a file"),
    (["agent", "fast-path", "host.py", "--workload", "gemm-allgather", "--llm", "openai:gpt-4.1", "--out",
      "locked/x.py"], "--out", "is not writable"),
    (["demo", "--out", "notes.txt/demo"], "--out", "notes.txt is a file"),
    (["demo", "--out", "locked/demo"], "--out", "is not writable"),
    # pseudo file systems pass os.access for root: the check makes (and removes) a file to know
    (["demo", "--out", "/proc/demo"], "--out /proc/demo cannot be created"),
    (["demo", "--out", "/sys/demo"], "--out /sys/demo cannot be created"),
    (["report", "run.sqlite", "--out", "/sys/report"], "--out /sys/report cannot be created"),
    (["export", "run.sqlite", "--out", "/proc/best.py"], "--out /proc/best.py cannot be created"),
    (["export", "run.sqlite", "--out", "/sys/best.py"], "--out /sys/best.py cannot be created"),
    # a file's folder is never made unasked
    (["export", "run.sqlite", "--out", "new/dir/best.py"], "folder", "new/dir does not exist"),
    (["agent", "fast-path", "host.py", "--workload", "gemm-allgather", "--out", "new/x.py"], "new does not exist"),
]
ARGUMENT_ERRORS = [
    # --budget and --stop-after
    (["evolve", "gemm-allgather", "--budget", "0"], "--budget '0' must be positive"),
    (["evolve", "gemm-allgather", "--budget", "-5m"], "--budget '-5m' must be positive"),
    (["evolve", "gemm-allgather", "--budget", "0s"], "must be positive"),
    (["evolve", "gemm-allgather", "--budget", "soon"], "budget 'soon' is neither"),
    (["evolve", "gemm-allgather", "--stop-after", "0m"], "--stop-after '0m' must be positive"),
    (["demo", "--budget", "0"], "--budget", "greater than or equal to 1"),
    # the candidate is checked before the GPUs
    (["bench", "gemm-allgather", "--candidate", "no_run.py"], "no_run.py", "run()"),
    (["bench", "gemm-allgather", "--candidate", "broken.py"], "broken.py", "syntax error"),
    (["bench", "gemm-allgather", "--candidate", "none.py"], "none.py: no such file"),
    (["bench", "gemm-allgather", "--candidate", "run.sqlite"], "run.sqlite"),
    # one of each argument kind per subcommand
    (["bench", "nope"], "unknown workload 'nope'"),
    (["evolve", "nope"], "unknown workload 'nope'"),
    (["agent", "fast-path", "host.py", "--workload", "nope"], "unknown workload 'nope'"),
    (["demo", "--workload", "nope"], "unknown workload 'nope'"),
    (["bench", "gemm-allgather", "--gpus", "3"], "runs on 1, 2, 4 GPUs, not 3"),
    (["evolve", "gemm-allgather", "--gpus", "3"], "runs on 1, 2, 4 GPUs, not 3"),
    (["bench", "kv-transfer", "--gpus", "1"], "runs on 2, 4 GPUs, not 1"),  # a transfer needs two ranks
    (["agent", "fast-path", "host.py", "--workload", "gemm-allgather", "--gpus", "3"], "not 3"),
    (["demo", "--gpus", "3"], "not 3"),
    (["bench", "gemm-allgather", "--gpus", "0"], "--gpus", "greater than or equal to 1"),
    (["bench", "gemm-allgather", "--shapes", "12xbanana"], "12xbanana"),
    (["evolve", "gemm-allgather", "--shape", "12xbanana"], "12xbanana"),
    (["bench", "gemm-allgather", "--shapes", "256x256"], "shape '256x256' is not", "or 'llama70b-M<M>'"),
    (["bench", "gemm-allgather", "--device", "tpu"], "--device must be cuda or cpu, not 'tpu'"),
    (["agent", "fast-path", "host.py", "--workload", "gemm-allgather", "--device", "tpu"], "--device"),
    (["bench", "gemm-allgather", "--iters", "3"], "--iters", "greater than or equal to 20"),
    (["bench", "gemm-allgather", "--frobnicate"], "No such option", "--frobnicate"),
    (["evolve", "gemm-allgather", "--islands", "0"], "--islands"),
    (["evolve", "gemm-allgather", "--llm-budget", "3"], "need --llm MODEL"),
    (["evolve", "gemm-allgather", "--pool-gpus", "2", "--cluster", "auto"], "give one of them"),
    (["evolve", "gemm-allgather", "--resume", "missing.sqlite"], "no run database at missing.sqlite"),
    (["evolve", "gemm-reducescatter", "--resume", "run.sqlite"], "is a run of 'gemm-allgather'"),
    (["agent", "fast-path", "missing.py", "--workload", "gemm-allgather"], "missing.py"),
    (["agent", "fast-path", "host.py", "--workload", "gemm-allgather", "--llm-budget", "1"], "need --llm MODEL"),
    (["export", "run.sqlite"], "Missing option '--out'"),
    (["report"], "Missing argument"),
    (["frobnicate"], "No such command"),
    # too few GPUs: what can run here instead
    (["evolve", "gemm-allgather"], "needs 1 CUDA GPU; this machine has 0", "commweave demo"),
    (["evolve", "kv-transfer"], "needs 2 CUDA GPUs; this machine has 0", "commweave demo"),
    (["bench", "gemm-allgather"], "needs 1 CUDA GPU;", "commweave demo", "--device cpu"),
    (["evolve", "gemm-allgather", "--resume", "run.sqlite"], "--gpus 4 needs 4 CUDA GPUs"),
    (["agent", "fast-path", "host.py", "--workload", "gemm-allgather"], "needs 1 CUDA GPU;", "--device cpu"),
]


@pytest.mark.parametrize("case", READ_ERRORS + OUTPUT_ERRORS + ARGUMENT_ERRORS, ids=lambda c: " ".join(c[0])[:60])
def test_user_error_is_one_line_exit_2_and_changes_nothing(place, case):
    args, *words = case
    user_error(place, args, *words)


def test_empty_file_is_left_empty_and_no_report_folder_appears(place):
    user_error(place, ["report", "empty.sqlite", "--out", "rep"])
    assert (place / "empty.sqlite").read_bytes() == b"" and not (place / "rep").exists()
    assert not list(place.glob("*-report"))


def test_reading_a_run_writes_nothing_beside_it(place):
    """report and export open the database read-only: no -wal/-shm, the file untouched."""
    before = snapshot(place)
    assert runner.invoke(app, ["report", "run.sqlite", "--out", "rep"]).exit_code == 0
    assert runner.invoke(app, ["export", "run.sqlite", "--out", "best.py"]).exit_code == 0
    after = snapshot(place)
    assert {k: v for k, v in after.items() if k in before} == before
    assert sorted(set(after) - set(before)) == ["best.py", "rep", "rep/evaluations.png", "rep/index.html",
                                                 "rep/islands.png"]


def test_a_second_demo_in_the_same_folder_is_refused(place):
    (place / "d").mkdir()
    (place / "d" / "demo.sqlite").write_bytes(b"")
    user_error(place, ["demo", "--out", "d"], "already holds a demo run")


def test_gpu_default_is_what_this_machine_has(monkeypatch):
    """--gpus defaults to the workload's largest world size that fits, else its smallest (refused)."""
    import commweave.runtime.capabilities as caps

    wl, rs, kv = get_workload("gemm-allgather"), get_workload("gemm-reducescatter"), get_workload("kv-transfer")
    for have, expect_ag, expect_rs, expect_kv in [(0, 1, 1, 2), (1, 1, 1, 2), (3, 2, 2, 2), (8, 4, 8, 4)]:
        monkeypatch.setattr(caps, "cuda_device_count", lambda have=have: have)
        assert (cli._default_gpus(wl), cli._default_gpus(rs), cli._default_gpus(kv)) == (expect_ag, expect_rs, expect_kv), have
    assert cli._default_gpus(wl, "cpu") == 1 and cli._default_gpus(kv, "cpu") == 2
    monkeypatch.setattr(caps, "cuda_device_count", lambda: 1)
    result = runner.invoke(app, ["evolve", "kv-transfer", "--budget", "5"])
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1
    assert "this machine has 1" in result.stderr and "commweave demo" in result.stderr
    on_one = result.stderr[result.stderr.index("a workload that runs on 1 GPU ("):]
    assert all(name in on_one for name in ("gemm-allgather", "attention-cp", "moe", "gemm-reducescatter"))
    assert "kv-transfer" not in on_one


def test_list_reads_at_80_columns():
    result = runner.invoke(app, ["list"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in result.output.replace("… (", "")  # only our own "… (N in all)": nothing cut
    for name, wl in registry().items():
        assert any(f"│ {name} " in line for line in lines), name
        for program in wl.baselines:
            assert program in result.output, program


def test_piped_output_is_not_wrapped_or_cut():
    """With stdout no terminal and COLUMNS unset, tables come at their full width and lines whole."""
    result = runner.invoke(app, ["list"], env={"COLUMNS": None})
    assert result.exit_code == 0
    assert "…" not in result.output.replace("… (", "")
    assert max(len(line) for line in result.output.splitlines()) > 80
    for name, wl in registry().items():
        for shape in wl.bench_shapes(max(wl.world_sizes))[:6]:
            assert shape.label in result.output, (name, shape.label)
    line = "run: /" + "/".join(["a-long-folder-name"] * 8) + "/run.sqlite"
    with cli.console.capture() as said:
        cli.console.print(line, highlight=False)
    assert said.get() == line + "\n"
