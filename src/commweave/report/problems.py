"""The table of `commweave problems run`: one self-contained HTML page of verdicts and speedups."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.2f}"
    return html.escape(str(value))


def write_table(rows: list[dict[str, Any]], summary: dict[str, Any], title: str, path: Path) -> Path:
    """Write the rows (suite.rows_json) and their summary as one HTML table to `path`."""
    head = ["problem", "verdict", "speedup", "reference µs", "solution µs", "seconds", "message"]
    body = []
    for r in rows:
        verdict = "ok" if r["ok"] else r["cause"]
        colour = "#e6f4e6" if r["in_band"] else ("#fff4d6" if r["ok"] else "#fbe3e3")
        cells = [r["problem"], verdict, r["speedup"], r["reference_us"], r["solution_us"], r["seconds"], r["message"]]
        body.append(f'<tr style="background:{colour}">' + "".join(f"<td>{_cell(c)}</td>" for c in cells) + "</tr>")
    causes = ", ".join(f"{k}: {v}" for k, v in sorted(summary["failed_by_cause"].items())) or "none"
    lo, hi = summary["band"]
    page = (f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>"
            "<style>body{font-family:sans-serif}td,th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:left}</style>"
            f"<h1>{html.escape(title)}</h1><p>{summary['problems']} problems: {summary['ok']} correct, "
            f"{summary['ok_in_band']} correct with speedup in [{lo}, {hi}]; failed by cause: {html.escape(causes)}</p>"
            "<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(body) + "</table>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path
