"""The run report: one self-contained HTML page (plots embedded as base64 PNG) plus the PNGs.

Sections: the run (workload, shape, GPUs, budget, evaluations, time), best speedup over
generations per island, every evaluation in order, the best program against each baseline and
the floor, the failure breakdown, the best program's directives and code, and its lineage. A run
of the simulated evaluator (run metadata `simulated: true`, e.g. `commweave demo`) says so in its
title, its run table and its timing tables: nothing in it was measured.
"""

from __future__ import annotations

import base64
import html
import io
from collections import Counter
from pathlib import Path
from typing import Any

from commweave.search.db import ProgramDB, ProgramRecord


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> str:
    """Write the figure to `path` and return it as base64 PNG."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _plt().close(fig)
    data = buf.getvalue()
    path.write_bytes(data)
    return base64.b64encode(data).decode()


def island_curves(programs: list[ProgramRecord], migrations: list[dict[str, Any]]) -> dict[int, list[tuple[int, float]]]:
    """Per island: (generation, best fitness so far), counting migrants from their arrival."""
    by_id = {p.id: p for p in programs}
    events: dict[int, list[tuple[int, float]]] = {}
    for p in programs:
        events.setdefault(p.island, []).append((p.generation, p.fitness if p.ok else 0.0))
    for m in migrations:
        src = by_id.get(m["program_id"])
        if src is not None and src.ok:
            events.setdefault(m["to_island"], []).append((m["generation"], src.fitness))
    curves = {}
    for island, items in sorted(events.items()):
        best, curve = 0.0, []
        for gen, fit in sorted(items):
            best = max(best, fit)
            if curve and curve[-1][0] == gen:
                curve[-1] = (gen, best)
            else:
                curve.append((gen, best))
        curves[island] = curve
    return curves


def _plot_islands(curves: dict[int, list[tuple[int, float]]], path: Path, note: str) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for island, curve in curves.items():
        xs, ys = zip(*curve)
        ax.step(xs, ys, where="post", label=f"island {island}", marker=".")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("generation")
    ax.set_ylabel("best speedup over the baseline")
    ax.set_title("best speedup per island" + note)
    ax.legend()
    return _save(fig, path)


def _plot_evaluations(programs: list[ProgramRecord], path: Path, note: str) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    ok = [(i, p.fitness) for i, p in enumerate(programs, 1) if p.ok]
    bad = [i for i, p in enumerate(programs, 1) if not p.ok]
    if ok:
        ax.scatter(*zip(*ok), s=12, label="correct")
    if bad:
        ax.scatter(bad, [0] * len(bad), s=14, marker="x", color="tab:red", label="failed")
    best, running = 0.0, []
    for p in programs:
        best = max(best, p.fitness if p.ok else 0.0)
        running.append(best)
    ax.plot(range(1, len(programs) + 1), running, color="black", lw=1, label="best so far")
    ax.set_xlabel("evaluation")
    ax.set_ylabel("speedup over the baseline")
    ax.set_title("every evaluation" + note)
    ax.legend()
    return _save(fig, path)


def _plot_failures(counts: Counter, path: Path, note: str) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 1 + 0.35 * len(counts)))  # bars of one height, however many classes
    names = sorted(counts, key=lambda k: -counts[k])
    ax.barh(names, [counts[n] for n in names], color="tab:red")
    ax.xaxis.get_major_locator().set_params(integer=True)  # counts: no 0.25 ticks
    ax.set_xlabel("programs")
    ax.set_title("failures by class" + note)
    return _save(fig, path)


def _table(header: list[str] | None, rows: list[list[Any]]) -> str:
    """An HTML table; `header` None for a key/value table (first column as row headings)."""
    head = "<tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in header) + "</tr>" if header else ""
    cell = "<th>{}</th>" if header is None else "<td>{}</td>"
    body = "".join("<tr>" + cell.format(row[0]) + "".join(f"<td>{c}</td>" for c in row[1:]) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _fmt(x: Any, spec: str = ",.1f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def _changed(child: ProgramRecord, parent: ProgramRecord | None) -> str:
    if parent is None or not child.directives or not parent.directives:
        return "-"
    from commweave.space import DirectiveSet

    a, b = DirectiveSet.from_dict(child.directives), DirectiveSet.from_dict(parent.directives)
    return ", ".join(f"{d}={a.get(d)!r}" for d in a.diff(b)) or "(same directives)"


CSS = """body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;font-size:90%}
th{background:#f3f3f3}summary{cursor:pointer;margin:1em 0}pre{background:#f6f6f6;padding:1em;overflow-x:auto;font-size:80%}img{max-width:100%}
.notice{background:#fff3cd;border:1px solid #e0c060;padding:.5em 1em}"""


def llm_rows(calls: list[dict[str, Any]], programs: list[ProgramRecord]) -> list[list[Any]]:
    """One row per model: its calls counted by outcome, tokens, dollars, and the programs it wrote
    (proposer = the model's name), how many were correct and the best fitness among them."""
    rows = []
    for model in sorted({c["model"] for c in calls}):
        mine = [c for c in calls if c["model"] == model]
        outcomes = Counter(c["outcome"] for c in mine)
        written = [p for p in programs if p.proposer == model]
        correct = [p for p in written if p.ok]
        rows.append([html.escape(model), html.escape(", ".join(f"{o} {n}" for o, n in outcomes.most_common())),
                     f"{sum(c['input_tokens'] for c in mine):,}", f"{sum(c['output_tokens'] for c in mine):,}",
                     _fmt(sum(c["cost"] for c in mine), ",.4f"), len(written), len(correct),
                     _fmt(max((p.fitness for p in correct), default=None), ".3f")])
    return rows


def report_dir(db_path: str | Path, out_dir: str | Path | None = None) -> Path:
    """Where a run's report goes: `out_dir`, else beside the database as '<name>-report'."""
    return Path(out_dir) if out_dir else Path(db_path).with_name(Path(db_path).stem + "-report")


def write_report(db_path: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write `index.html` and the PNGs into `out_dir` (default: beside the database, '<name>-report'),
    created only once the database has been read (read-only) and holds an evaluated program."""
    db_path = Path(db_path)
    with ProgramDB(db_path, readonly=True) as db:
        meta, programs, migrations, best = db.meta(), db.programs(), db.migrations(), db.best()
        lineage = db.lineage(best.id) if best else []
        calls = db.llm_calls()
    if not programs:
        raise ValueError(f"run {db_path} has no evaluated program yet")
    out = report_dir(db_path, out_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_id = {p.id: p for p in programs}
    failures = Counter(p.failure for p in programs if not p.ok)
    simulated = bool(meta.get("simulated"))
    measured = "simulated" if simulated else "median"
    note = " (simulated)" if simulated else ""

    images = {
        "islands": _plot_islands(island_curves(programs, migrations), out / "islands.png", note),
        "evaluations": _plot_evaluations(programs, out / "evaluations.png", note),
    }
    if failures:
        images["failures"] = _plot_failures(failures, out / "failures.png", note)

    def img(name: str, alt: str) -> str:
        return f'<img alt="{alt}" src="data:image/png;base64,{images[name]}">'

    budget = meta.get("budget") or {}
    elapsed = meta.get("elapsed_s")
    throughput = len(programs) / elapsed * 60 if elapsed else None
    waited = sum(p.timings.get("compile_wait_s", 0.0) for p in programs)
    gpus = f"{meta.get('gpus')} simulated (no GPU used)" if simulated else meta.get("gpus")
    run_rows = ([["evaluator", "simulated: fitness from a known landscape, no program was run or timed"]]
                if simulated else []) + [
                ["workload", meta.get("workload")], ["shape", meta.get("shape")], ["GPUs", gpus],
                ["budget", ", ".join(f"{k} {v}" for k, v in budget.items() if v) or "-"],
                ["evaluated", f"{len(programs)} ({len(programs) - sum(failures.values())} correct)"],
                ["islands", meta.get("islands")], ["migrations", len(migrations)],
                ["search time", f"{_fmt(meta.get('elapsed_s'), '.0f')} s"],
                ["throughput", f"{_fmt(throughput, '.1f')} candidates / minute"],
                *([] if simulated else [["evaluator waiting for compiles", f"{_fmt(waited, '.1f')} s in all"]]),
                ["proposer", meta.get("proposer")],
                ["started", meta.get("started_at")], ["database", db_path]]
    title = f"commweave run {db_path.stem}{note}"
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{CSS}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>"]
    if simulated:
        parts.append("<p class='notice'>A simulated run: the evaluator scored each program's directive set on a "
                     "known fitness landscape instead of compiling and timing it on GPUs. The search, database, "
                     "report and export are the real ones; the numbers are not measurements.</p>")
    parts += [_table(None, [[html.escape(str(k)), html.escape(str(v))] for k, v in run_rows]),
              "<h2>Best speedup over generations</h2>", img("islands", "best speedup per island"),
              img("evaluations", "every evaluation")]

    parts.append(f"<h2>Best program against the baselines and the floor{note}</h2>")
    if best is None:
        parts.append("<p>No program passed.</p>")
    else:
        t = best.timings
        ours = t.get("candidate_us")
        rows = [["ours (program %d)" % best.id, _fmt(ours), "-"]]
        for name, us in (t.get("baselines_us") or {}).items():
            speed = f"{us / ours:.2f}x" if us and ours else "-"
            rows.append([html.escape(name) + (" (fitness baseline)" if name == t.get("baseline") else ""), _fmt(us),
                         speed])
        floor = t.get("floor_us")
        rows.append(["floor", _fmt(floor), "-"])
        parts.append(_table(["program", f"{measured} µs", "ours faster by"], rows))
        if floor and ours:
            parts.append(f"<p>floor / ours = {floor / ours:.2f}; fitness {best.fitness:.3f}</p>")
        if len(t.get("baselines_us") or {}) == 1:
            parts.append(f"<p>A search times only its fitness baseline beside each candidate: <code>commweave bench "
                         f"{html.escape(str(meta.get('workload')))}</code> times every baseline.</p>")

    if calls:
        parts.append("<h2>LLM calls</h2>")
        parts.append(_table(["model", "calls (by outcome)", "input tokens", "output tokens", "$", "programs",
                             "correct", "best fitness"], llm_rows(calls, programs)))
        parts.append(f"<p>{_fmt(sum(c['cost'] for c in calls), ',.4f')} $ in all"
                     + (f" of a {_fmt(meta['llm_budget_usd'], ',.2f')} $ budget" if meta.get("llm_budget_usd") else "")
                     + (f"; stopped: {html.escape(str(meta['stop_reason']))}" if meta.get("stop_reason") else "") + "</p>")

    parts.append(f"<h2>Failures{note}</h2>")
    if failures:
        examples = {}
        for p in programs:
            if not p.ok and p.failure not in examples:
                examples[p.failure] = p
        parts.append(_table(["class", "programs", "first example"],
                            [[html.escape(str(k)), n, f"#{examples[k].id}: {html.escape(examples[k].message[:300])}"]
                             for k, n in failures.most_common()]))
        parts.append(img("failures", "failures by class"))
    else:
        parts.append("<p>None: every evaluated program passed.</p>")

    if best is not None:
        parts.append(f"<h2>Best program (#{best.id}, island {best.island}, generation {best.generation}){note}</h2>")
        if best.directives:
            flat = {k: v for k, v in best.directives.items() if k != "knobs"} | \
                   {f"knob {k}": v for k, v in (best.directives.get("knobs") or {}).items()}
            parts.append(_table(["directive", "value"], [[html.escape(k), html.escape(repr(v))] for k, v in flat.items()]))
        lines = best.code.count("\n") + 1  # folded: hundreds of lines would bury the lineage below
        parts.append(f"<details><summary>program text ({lines} lines)</summary><pre>{html.escape(best.code)}</pre></details>")
        parts.append("<h2>Lineage</h2>")
        rows = []
        for rec in lineage:
            parent = by_id.get(rec.parents[0]) if rec.parents else None
            rows.append([rec.id, rec.island, rec.generation, f"{rec.fitness:.3f}" if rec.ok else html.escape(str(rec.failure)),
                         html.escape(str(rec.timings.get("how", rec.proposer))), html.escape(_changed(rec, parent))])
        parts.append(_table(["program", "island", "generation", "fitness", "how", "changed from its parent"], rows))
    parts.append("</body></html>")
    page = out / "index.html"
    page.write_text("\n".join(parts))
    return page
