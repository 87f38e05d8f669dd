"""`commweave demo`: a whole simulated search on a CPU in under a minute, then its report and the
exported best program, each saying "simulated"; a measured run's report never does."""

from __future__ import annotations

import re
import time

from typer.testing import CliRunner

from commweave.cli import app
from commweave.ops import export_info, load
from commweave.report.html import write_report
from commweave.search import Budget, Evolution, ProgramDB, SearchConfig
from commweave.search.driver import run_meta
from commweave.search.simulate import SimulatedEvaluator
from commweave.workloads import get_workload

runner = CliRunner()


def test_demo_runs_a_simulated_search_and_says_so_everywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    result = runner.invoke(app, ["demo"])
    took = time.monotonic() - started
    assert result.exit_code == 0, result.output
    assert took < 60, f"demo took {took:.1f} s"
    (folder,) = (tmp_path / "runs").iterdir()
    assert folder.name.startswith("demo-")
    db = folder / "demo.sqlite"
    meta = run_meta(db)
    assert meta["simulated"] is True and meta["workload"] == "gemm-allgather" and meta["budget"]["evaluations"] == 150
    with ProgramDB(db, readonly=True) as run:
        assert run.count() == 150
        best = run.best()
    out = " ".join(result.stdout.split())
    assert "150 evaluations" in out and "(simulated)" in out and "Nothing here ran on a GPU" in out

    page = (folder / "demo-report" / "index.html").read_text()
    title = re.search(r"<title>(.*?)</title>", page).group(1)
    assert "simulated" in title and "simulated" in re.search(r"<h1>(.*?)</h1>", page).group(1)
    assert "<th>GPUs</th><td>4 simulated (no GPU used)</td>" in page
    assert "<th>evaluator</th><td>simulated" in page and "simulated µs" in page and "median µs" not in page
    for heading in re.findall(r"<h2>(.*?)</h2>", page):
        if heading.startswith(("Best program", "Failures")):
            assert "(simulated)" in heading, heading
    assert "<tr><th></th>" not in page  # no blank header row

    exported = (folder / "best.py").read_text()
    info = export_info(exported)
    assert info["simulated"] is True and info["program_id"] == best.id
    assert load(folder / "best.py").workload.name == "gemm-allgather"


def test_a_measured_run_never_says_simulated(tmp_path):
    """Without the run's `simulated` flag (a run of `commweave evolve`), no word of it in the report;
    without failures, no failure chart."""
    template = get_workload("gemm-allgather").template()
    path = tmp_path / "run.sqlite"
    with ProgramDB(path) as db:
        Evolution(db, template, SimulatedEvaluator(template, 4, template.seed_directives()), template.default_shape(4),
                  4, Budget(evaluations=6), SearchConfig(islands=2)).run()
    page = write_report(path, tmp_path / "rep").read_text()
    assert "simulated" not in page.lower()
    assert "<th>GPUs</th><td>4</td>" in page and "median µs" in page
    assert "failures by class" not in page and not (tmp_path / "rep" / "failures.png").exists()
    assert "None: every evaluated program passed." in page
