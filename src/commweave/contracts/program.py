"""Candidate programs: one Python text with the code that may change between EVOLVE-BLOCK markers.

    # EVOLVE-BLOCK-START
    CUDA_SRC = r\"\"\" ... extern "C" __global__ kernels using <nccl_device.h> ... \"\"\"
    def setup(ctx, shape): ...                 # collective: symmetric buffers, dev comms, kernels
    def run(ctx, state, inputs, out): ...      # writes this rank's result into `out`
    # EVOLVE-BLOCK-END

Optional: `teardown(ctx, state)`, and `available(ctx) -> str | None` (a reason the program cannot
run here, e.g. a peer baseline missing from this torch). `run` must leave all its work ordered
before the current stream (join side streams back) and must not modify `inputs`.

The calling process only parses a program (syntax, markers, functions, the CUDA source as a
literal, so it can be compiled ahead on CPU cores); it executes programs only inside workers.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import threading
import types
from dataclasses import dataclass

BLOCK_START = "EVOLVE-BLOCK-START"
BLOCK_END = "EVOLVE-BLOCK-END"
REQUIRED_FUNCTIONS = ("setup", "run")


class ProgramError(ValueError):
    """The program text is malformed (a compile_error for the cascade)."""


@dataclass(frozen=True)
class ParsedProgram:
    text: str
    cuda_sources: dict[str, str]  # module-level string constants whose name ends in CUDA_SRC
    functions: frozenset[str]

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]


#: CPython 3.11's ast.parse fails ("AST constructor recursion depth mismatch", gh-106905) while
#: another thread parses or compiles: the search parses on its main thread while model calls check
#: answers on theirs, so every parse and compile of a program text holds this lock.
PARSE_LOCK = threading.Lock()


def python_ast(text: str) -> ast.Module:
    """`ast.parse(text)` under PARSE_LOCK."""
    with PARSE_LOCK:
        return ast.parse(text)


def python_code(text: str, filename: str) -> types.CodeType:
    """`compile(text, filename, "exec")` under PARSE_LOCK."""
    with PARSE_LOCK:
        return compile(text, filename, "exec")


def parse_program(text: str) -> ParsedProgram:
    """Check a program's shape without running it."""
    try:
        tree = python_ast(text)
    except SyntaxError as exc:
        raise ProgramError(f"syntax error at line {exc.lineno}: {exc.msg}") from exc
    starts, ends = text.count(BLOCK_START), text.count(BLOCK_END)
    if starts != ends or starts == 0:
        raise ProgramError(f"expected matching {BLOCK_START}/{BLOCK_END} markers, found {starts} and {ends}")
    if text.index(BLOCK_START) > text.rindex(BLOCK_END):
        raise ProgramError(f"{BLOCK_END} comes before {BLOCK_START}")
    functions = frozenset(n.name for n in tree.body if isinstance(n, ast.FunctionDef))
    missing = [f for f in REQUIRED_FUNCTIONS if f not in functions]
    if missing:
        raise ProgramError(f"program does not define {', '.join(missing)}() at module level")
    sources: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name.endswith("CUDA_SRC"):
                if not (isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
                    raise ProgramError(f"{name} must be a plain string literal so it can be compiled ahead")
                sources[name] = node.value.value
    return ParsedProgram(text, sources, functions)


def load_program(text: str, name: str = "candidate") -> types.ModuleType:
    """Execute a program's text as a fresh module (workers only)."""
    parsed = parse_program(text)
    module = types.ModuleType(f"commweave_program_{name}_{parsed.digest}")
    module.__file__ = f"<program {name}>"
    exec(python_code(text, module.__file__), module.__dict__)
    return module


def unavailable_reason(module: types.ModuleType, ctx: object) -> str | None:
    """A loaded program's own reason it cannot run on this rank (its optional `available(ctx)`),
    or None when it can."""
    available = getattr(module, "available", None)
    reason = available(ctx) if available is not None else None
    return str(reason) if reason else None


def with_config(text: str, **knobs: object) -> str:
    """The program with entries of its module-level `CONFIG = dict(...)` set to new literal values.

    Edits the text (values are written with repr), so the result is an ordinary program that can be
    stored, diffed and evaluated like any other. Unknown knobs are an error, not silently added.
    """
    values = _config_spans(text)
    unknown = sorted(set(knobs) - set(values))
    if unknown:
        raise ProgramError(f"CONFIG has no knob {', '.join(unknown)} (has: {', '.join(sorted(values))})")
    data = text.encode()
    edits = [(*values[name], repr(value).encode()) for name, value in knobs.items()]
    for start, end, new in sorted(edits, reverse=True):
        data = data[:start] + new + data[end:]
    return data.decode()


@functools.lru_cache(maxsize=64)
def _config_spans(text: str) -> dict[str, tuple[int, int]]:
    """Byte spans of each `CONFIG = dict(...)` value in `text` (a template renders from the same
    text many times: parsed once)."""
    tree = python_ast(text)
    call = next((n.value for n in tree.body if isinstance(n, ast.Assign) and len(n.targets) == 1
                 and isinstance(n.targets[0], ast.Name) and n.targets[0].id == "CONFIG"), None)
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "dict"):
        raise ProgramError("program has no module-level CONFIG = dict(...) to set knobs in")
    # ast positions are UTF-8 byte columns: spans in the encoded text.
    line_starts = [0]
    for line in text.encode().splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))
    return {kw.arg: (line_starts[kw.value.lineno - 1] + kw.value.col_offset,
                     line_starts[kw.value.end_lineno - 1] + kw.value.end_col_offset)
            for kw in call.keywords if kw.arg}
