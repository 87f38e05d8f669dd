"""The import graph of src/commweave: no circle between modules, and no import from a lower layer
to a higher one (docs/ARCHITECTURE.md). Every import counts, those inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src"
#: lowest first; a module may import its own layer and those before it
LAYERS = ["contracts", "runtime", "space", "llm", "taco", "workloads", "evaluate", "problems", "search", "agents",
          "ops", "nn", "report", "cli", "__main__"]
RANK = {name: i for i, name in enumerate(LAYERS)}
RANK["nn"] = RANK["ops"]  # ops and nn are one layer: nn's layers call the ops, the ops' backward nothing of nn


def _modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "commweave").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target.startswith("commweave") and target != name:
                out.add(target)
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "commweave"


def test_no_import_from_a_lower_layer_to_a_higher_one() -> None:
    modules = _modules()
    upward = []
    for name, path in modules.items():
        for target in _imports(name, path, modules):
            a, b = _layer(name), _layer(target)
            if a in RANK and b in RANK and RANK[b] > RANK[a]:
                upward.append(f"{name} -> {target}")
    assert not upward, upward


def test_no_import_circle() -> None:
    modules = _modules()
    graph = {name: {t for t in _imports(name, path, modules) if t != "commweave"} for name, path in modules.items()}
    # a package's __init__ re-exporting its own modules is not a circle of ideas: drop package -> own child
    for name in graph:
        graph[name] = {t for t in graph[name] if not t.startswith(name + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not circles, circles
