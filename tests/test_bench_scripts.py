"""bench/ holds what a user or the docs need: each script's first doc line names the figure it
produces ("Figure: ..."), and every bench/ script the README, docs/ or the NOTES cite exists."""

from __future__ import annotations

import ast
import re
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
