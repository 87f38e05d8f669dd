"""bench/ holds what a user or the docs need: each script's first doc line names the figure it
produces ("Figure: ..."), and every bench/ script the README, docs/ or the NOTES cite exists."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
BENCH = ROOT / "bench"


def first_doc_line(path: Path) -> str:
    """A Python script's docstring's first line, or a shell script's first comment after the #!."""
    text = path.read_text()
    if path.suffix == ".py":
        doc = ast.get_docstring(ast.parse(text)) or ""
        return doc.splitlines()[0] if doc else ""
    comments = [line for line in text.splitlines()[1:] if line.startswith("#")]
    return comments[0].lstrip("# ") if comments else ""


def test_every_bench_script_names_its_figure():
    scripts = sorted(BENCH.glob("*.py")) + sorted(BENCH.glob("*.sh"))
    assert scripts
    unnamed = [p.name for p in scripts if not first_doc_line(p).startswith("Figure: ")]
    assert not unnamed, f"first doc line does not start 'Figure: ': {unnamed}"


def test_every_cited_bench_script_exists():
    """A doc paragraph may name a deleted probe only to say so ('removed after <commit>')."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "src").rglob("NOTES.md"))]
    missing = [(str(doc.relative_to(ROOT)), name)
               for doc in docs for paragraph in doc.read_text().split("\n\n")
               for name in re.findall(r"bench/([\w-]+\.(?:py|sh))", paragraph)
               if not (BENCH / name).exists() and not re.search(r"removed after [0-9a-f]{7}", paragraph)]
    assert not missing, f"docs cite bench scripts that are gone: {missing}"


def test_search_rate_reads_a_run_database(tmp_path):
    """bench/search_rate.py: three evaluations 10 s apart are 6 a minute from the first result on,
    and each keeps its judge time, host median and calls per batch."""
    import importlib.util
    import sqlite3

    from commweave.search.db import ProgramDB

    path = tmp_path / "run.sqlite"
    with ProgramDB(path) as db:
        db.set_meta(workload="toy", shape="64x64x64", gpus=1, elapsed_s=25.0)
        for i in range(3):
            db.add_program(code=f"# {i}", directives=None, island=0, generation=i, status="ok", fitness=1.0,
                           timings={"evaluate_s": 2.0 + i, "candidate_us": 10.0, "baselines_us": {"host": 11.0},
                                    "resolution": {"host": {"batch": 40 + i, "crossing_us": 290.0, "hold_expired": 0}}})
    with sqlite3.connect(path) as conn:
        for i in range(3):
            conn.execute("UPDATE programs SET created_at = ? WHERE id = ?", (f"2026-12-06T06:00:{10 * i:02d}+00:00", i + 1))
    spec = importlib.util.spec_from_file_location("search_rate", BENCH / "search_rate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    run = module.summarize(path)
    assert run["evaluations"] == 3 and run["steady_per_min"] == 6.0 and run["mean_evaluate_s"] == 3.0
    assert [e["batch"] for e in run["per_evaluation"]] == [{"host": 40}, {"host": 41}, {"host": 42}]
    assert run["per_evaluation"][0]["host_us"] == 11.0


def test_confine_start_times_a_program_process_and_its_confinement():
    """bench/confine_start.py (CPU, one program process): spawn-to-ready covers the confinement's
    own share, which the process measured, under no optional piece and under the pid namespace."""
    import importlib.util

    from commweave.runtime.candidate import Confinement

    spec = importlib.util.spec_from_file_location("confine_start", BENCH / "confine_start.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for rules in (Confinement(False, False), module.VARIANTS["pid namespace"]):
        ready, confine = module.started(rules)
        assert 0 < confine < ready < 60


def test_problems_gpu_script_judges_until_its_deadline_and_archives(tmp_path):
    """bench/problems_gpu.sh on CPU (DEVICE=cpu, 1 rank, our PKB-layout folder): the run's JSON and
    log come back in one archive, and the summary names no problem as not judged; with under 25 s
    left nothing starts and the summary names what was not; `twice` of a problem that is not there
    is one line and exit 2."""
    import os
    import subprocess
    import tarfile

    env = {**os.environ, "DEVICE": "cpu", "OUT": str(tmp_path), "COMMWEAVE_PKB": str(ROOT / "tests" / "problems" / "pkb"),
           "PROBLEM_OPTIONS": "--shape 64x32 --dtype float32 --trials 2 --iters 3 --warmup 1"}
    script = str(BENCH / "problems_gpu.sh")
    done = subprocess.run(["bash", script, "run", "120", "3"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3_scaled_allreduce: ok" in done.stdout
    with tarfile.open(tmp_path / "problems-gpu-run.tgz") as archive:
        names = archive.getnames()
        [table] = [n for n in names if n.endswith(".json")]
        rows = json.load(archive.extractfile(table))["rows"]
    assert "./problems.log" in names and [(r["problem"], r["ok"]) for r in rows] == [("3_scaled_allreduce", True)]
    assert "not judged" not in done.stdout, done.stdout
    late = subprocess.run(["bash", script, "run", "10", "3", "16"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert late.returncode == 0 and "not started" in late.stdout and "3 16" in late.stdout, late.stdout
    missing = subprocess.run(["bash", script, "twice", "99"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no problem 99" in missing.stderr, missing.stderr


def test_problem_phases_times_a_judge_by_part(tmp_path):
    """bench/problem_phases.py on CPU (2 ranks, our own problem judging itself): the evaluation's
    phases fit inside the judge's time, and the results JSON is written where asked."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, str(BENCH / "problem_phases.py"), str(ROOT / "tests" / "problems" / "allgather_matmul.py"),
                           "--device", "cpu", "--gpus", "2", "--trials", "2", "--warmup", "1", "--iters", "3",
                           "--out-dir", str(tmp_path)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    [written] = tmp_path.glob("problems-judge-phases-cpu-*.json")
    [row] = json.loads(written.read_text())["rows"]
    assert row["verdict"]["ok"] and row["world_size"] == 2 and row["iters"] == 3
    [evaluation] = row["evaluations"]
    assert {"checks", "warmup", "timing"} <= set(evaluation["phases"])
    # each phase is the slowest rank's: their sum stays within every rank's share of the evaluation
    assert 0 < sum(evaluation["phases"].values()) <= evaluation["seconds"] * row["world_size"]
    assert evaluation["seconds"] <= row["judge_s"]
