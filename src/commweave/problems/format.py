"""What a problem is, and where one comes from: a file of our format, or a ParallelKernelBench file.

A problem is a reference program in plain PyTorch + torch.distributed (`solution(*args)`, called on
every rank of the default group), an input maker (this rank's arguments from a seed), and a
tolerance. Our format is one Python file with both (docs/problems.md):

    WORLD_SIZES = (2, 4)            # optional: the rank counts it is defined at (default 1, 2, 4, 8)
    DEVICES = ("cpu", "cuda")       # optional: where its reference runs (default both)
    TOLERANCE = 1e-2                # optional: largest relative Frobenius error of a result
    def make_inputs(rank, world_size, seed, device): return (...)
    def solution(*args): ...

A ParallelKernelBench reference (`<pkb>/reference/<id>_<name>.py`) is read in place: its inputs come
from `<pkb>/utils/input_output_tensors.create_input_tensor` (problem id from the file name, PKB's
base shape 1024x1024 and bfloat16 unless told otherwise), with the judge's seed as PKB's `trial`.
The caller's process only reads files here; the problem's code runs in its reference workers.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

PKB_INPUTS = Path("utils") / "input_output_tensors.py"
PKB_SHAPE = (1024, 1024)  # PKB's default --m/--n
PKB_DTYPE = "bfloat16"  # PKB's default --dtype (its paper's runs)
DEFAULT_TOLERANCE = 1e-2  # PKB judges at atol = rtol = 1e-2
DEFAULT_WORLD_SIZES = (1, 2, 4, 8)
DTYPES = ("float32", "bfloat16", "float16", "float64")


class ProblemError(ValueError):
    """A problem or solution file that cannot be used (one line, naming the file and what is wrong)."""


@dataclass(frozen=True)
class Problem:
    """A problem as the judge needs it; JSON-serialisable, so it travels to judges by value."""

    name: str
    reference: str  # the file defining solution(*args)
    kind: str  # "file" (our format) or "pkb"
    inputs: str  # the file defining the input maker (the reference itself for "file")
    problem_id: int = 0  # PKB's problem number
    base_shape: tuple[int, int] = PKB_SHAPE  # PKB's (M, N)
    dtype: str = PKB_DTYPE  # PKB's dtype
    tolerance: float = DEFAULT_TOLERANCE
    world_sizes: tuple[int, ...] = DEFAULT_WORLD_SIZES
    devices: tuple[str, ...] = ("cpu", "cuda")

    @property
    def label(self) -> str:
        """The shape label the judge's reports show."""
        return f"{self.base_shape[0]}x{self.base_shape[1]}-{self.dtype}" if self.kind == "pkb" else "inputs"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Problem:
        data = json.loads(text)
        data["base_shape"] = tuple(data["base_shape"])
        data["world_sizes"] = tuple(data["world_sizes"])
        data["devices"] = tuple(data["devices"])
        return cls(**data)

    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def unsupported(self, world_size: int, device: str) -> str | None:
        """Why this problem cannot run at `world_size` on `device` by its own declaration, or None."""
        if world_size not in self.world_sizes:
            return f"problem {self.name} is defined at {', '.join(map(str, self.world_sizes))} ranks, not {world_size}"
        if device not in self.devices:
            return f"problem {self.name} needs {' or '.join(self.devices)} (its DEVICES), not {device}"
        return None


def _constants(path: Path, tree: ast.Module) -> dict[str, object]:
    """Module-level NAME = literal assignments (read, never executed)."""
    found: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                found[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return found


def _parsed(path: Path) -> ast.Module:
    if not path.is_file():
        raise ProblemError(f"{path}: no such file")
    try:
        return ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as exc:
        raise ProblemError(f"{path}: syntax error at line {exc.lineno}: {exc.msg}") from None


def defines(tree: ast.Module, name: str) -> bool:
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in tree.body)


def check_solution_file(path: Path) -> str:
    """The text of a solution file, after checking it parses and defines solution() at module level."""
    tree = _parsed(path)
    if not defines(tree, "solution"):
        raise ProblemError(f"{path}: defines no solution() at module level")
    return path.read_text()


def pkb_root(path: Path) -> Path | None:
    """The PKB checkout a reference file sits in (`<root>/reference/<id>_<name>.py`), or None."""
    root = path.resolve().parent.parent
    if path.resolve().parent.name == "reference" and (root / PKB_INPUTS).is_file() and re.match(r"\d+_", path.name):
        return root
    return None


def load_problem(path: Path | str, *, base_shape: tuple[int, int] | None = None, dtype: str | None = None,
                 tolerance: float | None = None) -> Problem:
    """The problem in `path`: a PKB reference inside its checkout, or a file of our format."""
    path = Path(path)
    tree = _parsed(path)
    if dtype is not None and dtype not in DTYPES:
        raise ProblemError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if tolerance is not None and not tolerance > 0:
        raise ProblemError(f"tolerance must be > 0, got {tolerance}")
    if not defines(tree, "solution"):
        raise ProblemError(f"{path}: defines no solution() at module level, so it is no problem's reference")
    root = pkb_root(path)
    if root is not None:
        return Problem(name=path.stem, reference=str(path.resolve()), kind="pkb", inputs=str(root / PKB_INPUTS),
                       problem_id=int(path.name.split("_")[0]), base_shape=base_shape or PKB_SHAPE,
                       dtype=dtype or PKB_DTYPE, tolerance=tolerance or DEFAULT_TOLERANCE)
    if not defines(tree, "make_inputs"):
        raise ProblemError(f"{path}: defines no make_inputs(rank, world_size, seed, device) and is not a "
                           f"ParallelKernelBench reference (<pkb>/reference/<id>_<name>.py beside <pkb>/{PKB_INPUTS})")
    if base_shape is not None:
        raise ProblemError(f"{path}: --shape applies to ParallelKernelBench problems; this file makes its own inputs")
    consts = _constants(path, tree)
    sizes = consts.get("WORLD_SIZES", DEFAULT_WORLD_SIZES)
    devices = consts.get("DEVICES", ("cpu", "cuda"))
    tol = tolerance or consts.get("TOLERANCE", DEFAULT_TOLERANCE)
    if not (isinstance(sizes, tuple) and sizes and all(isinstance(w, int) and w >= 1 for w in sizes)):
        raise ProblemError(f"{path}: WORLD_SIZES must be a tuple of positive ints, got {sizes!r}")
    if not (isinstance(devices, tuple) and devices and set(devices) <= {"cpu", "cuda"}):
        raise ProblemError(f"{path}: DEVICES must be a tuple of 'cpu' and/or 'cuda', got {devices!r}")
    if not (isinstance(tol, float) and tol > 0):
        raise ProblemError(f"{path}: TOLERANCE must be a positive float, got {tol!r}")
    return Problem(name=path.stem, reference=str(path.resolve()), kind="file", inputs=str(path.resolve()),
                   dtype=dtype or "float32", tolerance=tol, world_sizes=sizes, devices=devices)


def pkb_problems(root: Path | str, **options: object) -> list[Problem]:
    """Every reference of a PKB checkout, by problem number."""
    root = Path(root)
    if not (root / PKB_INPUTS).is_file() or not (root / "reference").is_dir():
        raise ProblemError(f"{root}: not a ParallelKernelBench checkout (no reference/ and {PKB_INPUTS})")
    files = sorted((p for p in (root / "reference").glob("*.py") if re.match(r"\d+_", p.name)),
                   key=lambda p: int(p.name.split("_")[0]))
    return [load_problem(p, **options) for p in files]


def problems_in(folder: Path | str, **options: object) -> list[Problem]:
    """Every problem file of our format in `folder` (or, for a PKB checkout, its references)."""
    folder = Path(folder)
    if (folder / PKB_INPUTS).is_file():
        return pkb_problems(folder, **options)
    if not folder.is_dir():
        raise ProblemError(f"{folder}: not a folder of problems")
    files = sorted(p for p in folder.glob("*.py") if defines(_parsed(p), "make_inputs"))
    if not files:
        raise ProblemError(f"{folder}: holds no problem file (a .py defining make_inputs and solution)")
    return [load_problem(p, **options) for p in files]
