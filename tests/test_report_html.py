"""The run report: one HTML page holding its plots and tables, PNGs beside it."""

from __future__ import annotations

import base64
import re

import pytest

from commweave.report.html import island_curves, write_report
from commweave.search import Budget, Evolution, ProgramDB, SearchConfig
from commweave.search.simulate import SimulatedEvaluator
from commweave.workloads import get_workload


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    t = get_workload("gemm-allgather").template()
    path = tmp_path_factory.mktemp("rep") / "run.sqlite"
    ev = SimulatedEvaluator(t, 4, t.seed_directives().with_(comm_ctas=16, sync="chunk", chunk_bytes=2 << 20),
                            rules=[lambda ds: "timeout" if ds.comm_ctas == 32 else None,
                                   lambda ds: "nan" if ds.get("knob:threads") == 128 else None])
    with ProgramDB(path) as db:
        Evolution(db, t, ev, t.default_shape(4), 4, Budget(evaluations=40), SearchConfig(islands=2, seed=2,
                                                                                          migrate_every=3)).run()
    return path


def test_report_holds_plots_tables_code_and_lineage(run, tmp_path):
    page = write_report(run, tmp_path / "out")
    text = page.read_text()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    assert len(images) == 3
    for data in images:
        assert base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("islands.png", "evaluations.png", "failures.png"):
        assert (tmp_path / "out" / name).read_bytes()[:4] == b"\x89PNG"
    assert "src=\"http" not in text and "<script" not in text  # self-contained
    for words in ("gemm-allgather", "8192x8192x8192", "against the baselines and the floor", "host (fitness baseline)",
                  "floor / ours", "timeout", "nan", "Lineage", "changed from its parent", "EVOLVE-BLOCK-START",
                  "knob threads", "commweave-directives", "candidates / minute", "waiting for compiles",
                  "times only its fitness baseline"):
        assert words in text, words
    with ProgramDB(run) as db:
        best = db.best()
        assert f"Best program (#{best.id}" in text and f"ours (program {best.id})" in text
        assert len(db.lineage(best.id)) == text.count("<tr>", text.index("Lineage")) - 1
    assert "LLM calls" not in text  # an offline run has none


def test_report_counts_llm_calls_per_model(run, tmp_path):
    """Calls by outcome, tokens and dollars per model, and the programs each model wrote."""
    import shutil

    path = tmp_path / "llm.sqlite"
    shutil.copy(run, path)
    with ProgramDB(path) as db:
        first = db.programs()[0]
        db.conn.execute("UPDATE programs SET proposer = 'gpt' WHERE id = ?", (first.id,))
        db.add_llm_call(model="gpt", purpose="propose", outcome="ok", input_tokens=1200, output_tokens=300, cost=0.0125,
                        program_id=first.id)
        db.add_llm_call(model="gpt", purpose="propose", outcome="rate_limited", message="429")
        db.add_llm_call(model="local", purpose="propose", outcome="malformed:no_match", input_tokens=50, output_tokens=7)
        db.set_meta(llm_budget_usd=5.0, stop_reason="budget")
    text = write_report(path, tmp_path / "out").read_text()
    section = text[text.index("<h2>LLM calls</h2>"):text.index("<h2>Failures</h2>")]
    gpt = section[section.index("<td>gpt</td>"):]
    gpt = gpt[:gpt.index("</tr>")]
    assert "ok 1, rate_limited 1" in gpt and "1,200" in gpt and "0.0125" in gpt and f"{first.fitness:.3f}" in gpt
    assert "malformed:no_match 1" in section and "0.0125 $ in all of a 5.00 $ budget; stopped: budget" in section


def test_island_curves_are_running_maxima(run):
    with ProgramDB(run) as db:
        curves = island_curves(db.programs(), db.migrations())
    assert set(curves) == {0, 1}
    for curve in curves.values():
        gens = [g for g, _ in curve]
        fits = [f for _, f in curve]
        assert gens == sorted(set(gens)) and fits == sorted(fits)


def test_report_of_a_missing_run_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no run database"):
        write_report(tmp_path / "nothing.sqlite")
