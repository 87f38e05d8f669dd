"""The examples run as their first docstring says (the command at the top of each, run as written
from the repository root), on CPU, and end well: a user's first contact must not be a traceback."""

from __future__ import annotations

import ast
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
#: the examples that run on CPU, and a line each must print
CPU_EXAMPLES = {
    "tp_mlp_training.py": "in 30 steps",
    "judge_a_program.py": "x the host baseline",
}


def command_of(path: Path) -> list[str]:
    """The command in the example's docstring (its first line that runs the file), as argv."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    lines = [line.strip() for line in doc.splitlines() if f"examples/{path.name}" in line]
    assert lines, f"{path.name}'s docstring does not say how to run it"
    argv = shlex.split(lines[0])
    launcher = {"python": [sys.executable], "torchrun": [sys.executable, "-m", "torch.distributed.run"]}
    assert argv[0] in launcher, lines[0]
    return launcher[argv[0]] + argv[1:]


@pytest.mark.parametrize("name", sorted(CPU_EXAMPLES))
def test_example_runs_on_cpu(name: str) -> None:
    argv = command_of(ROOT / "examples" / name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr[-3000:]}"
    assert CPU_EXAMPLES[name] in done.stdout, done.stdout
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_every_example_says_how_to_run_it() -> None:
    for path in sorted((ROOT / "examples").glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert f"examples/{path.name}" in doc, f"{path.name}'s docstring does not give its command"
