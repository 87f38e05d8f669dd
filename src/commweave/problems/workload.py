"""A problem as a commweave `Workload`, so the existing judge (`Evaluator`) checks and times it.

Inputs: this rank's tensor arguments (`t0`, `t1`, ...) plus `args`, the pickled skeleton of the
rest (values.py), drawn by the reference workers (service.py) from the judge's own seed. Output: a
float32 vector of the result's elements (values.flatten_result) of a capacity fixed per rank by a
first probe; a problem whose result length varies with the seed marks the tail past each seed's
length `untouched`. Reference: the problem's reference result of that seed from the same workers.
Baseline: the reference wrapped as a program (program.py), named 'reference'.

Judges rebuild a workload from 'module:Class' with no arguments: `workload_for` makes a subclass
whose name encodes the problem and its layout, and this module's `__getattr__` rebuilds it there.
"""

from __future__ import annotations

import functools
import json
import math
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any

import torch

from commweave.contracts.verdict import WorkloadError
from commweave.contracts.workload import Cost, Shape, Workload
from commweave.problems.format import Problem
from commweave.problems.program import solution_program
from commweave.problems.service import ReferenceWorkers
from commweave.problems.values import ARGS, constant_key, inline_tensors, pack_pickled, skeleton_bytes

PREFIX = "problem_"
REFERENCE = "reference"  # the baseline's name: the problem's own reference as a program
CACHED_SEEDS = 16
PREFETCH_BYTES = 64 << 20  # a batch's draws per request to the reference workers (and held at once), at most
VARYING = "inputs vary in shape"  # the cause of a problem whose varying input tensors do not fit the skeleton's room
#: a draw whose skeleton is not the probe's constant one: the judge judges again, reading it per call
UNSTEADY = "arguments the probe saw constant changed"


@dataclass(frozen=True)
class Layout:
    """Per rank: the output's capacity and the skeleton's bytes; `fixed`: every seed's result
    has exactly that length (no untouched tail); `inputs`: per rank, each tensor argument's shape
    as the probe drew it (the judge's buffers have that size); a tensor drawn in another shape
    travels by value inside the skeleton, whose room counts twice the bytes of those the probe saw
    vary. `constant`: per rank, the skeleton's pickle (hex) where every probed seed drew the same,
    else '': the program gets it once, at setup, in the shape (`Bound`), instead of reading the
    `args` input back from the GPU on every call, a wait for the GPU that would stall each batch
    until the judge's hold let go."""

    out: tuple[int, ...]
    args: tuple[int, ...]
    fixed: bool
    inputs: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]
    constant: tuple[str, ...]


_WORKERS: dict[tuple[int, str], ReferenceWorkers] = {}  # this process's reference workers
_HOLDER: list[ProblemWorkload] = []  # the one workload whose draws and results this process holds


def reference_workers(problem: Problem, world_size: int, device: str) -> ReferenceWorkers:
    """This process's workers at (`world_size`, `device`) with `problem` loaded (started at first
    use, again after they failed)."""
    key = (world_size, device)
    if key not in _WORKERS or not _WORKERS[key].alive:
        _WORKERS[key] = ReferenceWorkers(world_size, device)
    _WORKERS[key].load(problem)
    return _WORKERS[key]


class ProblemWorkload(Workload):
    """One problem at one world size (subclasses made by `workload_for` carry which)."""

    problem: Problem
    layout: Layout
    dtype = torch.float32
    baselines = (REFERENCE,)
    seed = REFERENCE
    inputs_read_only = False  # PKB solutions all-reduce their arguments in place; the reference is the seed's

    def __init__(self) -> None:
        self.name = f"problem:{self.problem.name}"
        self.summary = f"{self.problem.kind} problem {self.problem.reference}"
        self.world_sizes = (len(self.layout.out),)
        self._results: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()
        self._next: dict[int, list[int]] = {}  # per rank: the prepared seeds not drawn yet, in order
        self._drawn: dict[int, dict[int, Any]] = {}  # per rank, per seed: draws made together, not yet taken

    # -- programs ---------------------------------------------------------------------------------
    def program_names(self) -> list[str]:
        return [REFERENCE]

    def program_text(self, name: str) -> str:
        if name != REFERENCE:
            raise KeyError(f"problem {self.problem.name!r} has one program, {REFERENCE!r}, not {name!r}")
        with open(self.problem.reference) as f:
            return solution_program(f.read(), self.problem.reference)

    # -- shapes -----------------------------------------------------------------------------------
    @property
    def shape(self) -> Shape:
        """The problem's one size; its params carry the constant skeletons (`Layout.constant`)."""
        return Shape(self.problem.label, {constant_key(rank): text for rank, text in enumerate(self.layout.constant)
                                          if text})

    def bench_shapes(self, world_size: int) -> list[Shape]:
        return [self.shape]

    def check_shapes(self, world_size: int) -> list[Shape]:
        """The problem's one size: its input maker defines it (PKB's base shape)."""
        return [self.shape]

    def parse_shape(self, text: str, world_size: int) -> Shape:
        if text != self.shape.label:
            raise ValueError(f"problem {self.problem.name} has one shape, {self.shape.label}, not {text!r}")
        return self.shape

    # -- values -----------------------------------------------------------------------------------
    def _workers(self, world_size: int, device: torch.device) -> ReferenceWorkers:
        """The reference workers, this workload's problem loaded. The workload the judge used before
        (judges keep every workload they built) lets go of what it held first: on GPUs its draws
        and results are the workers' memory, which they free only once the judge lets go."""
        if _HOLDER and _HOLDER[0] is not self:
            _HOLDER[0].let_go()
        _HOLDER[:] = [self]
        return reference_workers(self.problem, world_size, device.type)

    def let_go(self) -> None:
        """Drop the draws and reference results held for later calls."""
        self._results.clear()
        self._next.clear()
        self._drawn.clear()

    def make_inputs(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
        """This rank's tensors in the judge's buffers (their probed shapes), and the skeleton. A
        tensor drawn in another shape (PKB #70: a ragged values tensor; #85: a rank empty 1 seed
        in 4) travels by value in the skeleton, its buffer left zero."""
        tensors, skeleton = self._draw(world_size, rank, seed, device)
        probed = dict(self.layout.inputs[rank])
        missing = sorted(set(probed) - set(tensors))
        if missing or len(tensors) != len(probed):
            raise WorkloadError(f"{VARYING}: rank {rank}'s input tensors {sorted(tensors)} are not the probe's "
                                f"{sorted(probed)} (their number changes with the seed)")
        moved = {name: t.to(device) for name, t in tensors.items() if tuple(t.shape) != probed[name]}
        pickled = skeleton_bytes(inline_tensors(skeleton, moved))  # a moved tensor's value makes it differ
        constant = self.layout.constant[rank]
        if constant and pickled.hex() != constant:
            raise WorkloadError(f"{UNSTEADY}: rank {rank}'s arguments (their non-tensor values or tensor shapes) "
                                f"changed with the seed, though the probe's draws had the same")
        inputs = {name: torch.zeros(probed[name], dtype=t.dtype, device=device) if name in moved else t.to(device)
                  for name, t in tensors.items()}
        try:
            inputs[ARGS] = pack_pickled(pickled, self.layout.args[rank]).to(device)
        except ValueError as exc:
            what = ", ".join(f"{n} {tuple(t.shape)} (probed {probed[n]})" for n, t in moved.items())
            raise WorkloadError(f"{VARYING}: rank {rank}'s input tensor {what} changes shape with the seed and "
                                f"does not fit the room its first draws left: {exc}") from exc
        return inputs

    def prepare_inputs(self, shape: Shape, world_size: int, rank: int, seeds: list[int], device: torch.device) -> None:
        """Remember a batch's seeds: its draws are then made several to a request (each request a
        round trip to every worker, as costly as a small draw)."""
        self._next[rank] = list(seeds)
        self._drawn[rank] = {}

    def _draw(self, world_size: int, rank: int, seed: int, device: torch.device) -> Any:
        """(tensors, skeleton) of `seed`: a prepared seed comes with those after it, up to
        `PREFETCH_BYTES` of tensors (reckoned at 8 bytes an element) held at once."""
        pending, drawn = self._next.setdefault(rank, []), self._drawn.setdefault(rank, {})
        if seed not in drawn and seed in pending:
            elements = sum(math.prod(dims) for _, dims in self.layout.inputs[rank])
            begin = pending.index(seed)
            part = pending[begin:begin + max(1, PREFETCH_BYTES // (8 * elements + 1))]
            del pending[:begin + len(part)]
            drawn.clear()
            drawn.update(zip(part, self._workers(world_size, device).draws(part, rank)))
        if seed in drawn:
            return drawn.pop(seed)
        return self._workers(world_size, device).draws([seed], rank)[0]

    def make_output(self, shape: Shape, world_size: int, rank: int, device: torch.device) -> torch.Tensor:
        return torch.empty(self.layout.out[rank], dtype=torch.float32, device=device)

    def _result(self, world_size: int, rank: int, seed: int, device: torch.device) -> torch.Tensor:
        key = (rank, seed)
        if key not in self._results:
            self._results[key] = self._workers(world_size, device).request(REFERENCE, seed, rank)
            while len(self._results) > CACHED_SEEDS:
                self._results.popitem(last=False)
        return self._results[key]

    def reference(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> torch.Tensor:
        result = self._result(world_size, rank, seed, device)
        capacity = self.layout.out[rank]
        if result.numel() > capacity:
            raise ValueError(f"the reference's result has {result.numel()} elements on rank {rank}, more than the "
                             f"{capacity} its first probes had (a result whose size varies this much cannot be judged)")
        padded = torch.zeros(capacity, dtype=torch.float32, device=device)
        padded[:result.numel()] = result  # on GPUs already there (the workers' IPC), copied device to device
        return padded

    def untouched(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> torch.Tensor | None:
        if self.layout.fixed:
            return None
        length = self._result(world_size, rank, seed, device).numel()
        return (torch.arange(self.layout.out[rank]) >= length).to(device)

    def cost(self, shape: Shape, world_size: int) -> Cost:
        """Unknown for a problem: no floor (zero work never flags a time as too fast)."""
        return Cost()

    def tolerance(self) -> float:
        return self.problem.tolerance


@functools.lru_cache(maxsize=None)
def _workload_class(token: str) -> type[ProblemWorkload]:
    spec = json.loads(bytes.fromhex(token[len(PREFIX):]).decode())
    inputs = tuple(tuple((name, tuple(shape)) for name, shape in rank) for rank in spec["layout"]["inputs"])
    layout = Layout(tuple(spec["layout"]["out"]), tuple(spec["layout"]["args"]), spec["layout"]["fixed"], inputs,
                    tuple(spec["layout"]["constant"]))
    cls = type(token, (ProblemWorkload,), {"problem": Problem.from_json(spec["problem"]), "layout": layout,
                                           "__module__": __name__, "__qualname__": token})
    return cls


def workload_for(problem: Problem, layout: Layout) -> ProblemWorkload:
    """The workload of `problem` with `layout`, rebuildable by name in any judge process."""
    spec = json.dumps({"problem": problem.to_json(), "layout": asdict(layout)}, sort_keys=True)
    return _workload_class(PREFIX + spec.encode().hex())()


def __getattr__(name: str) -> Any:
    """Judges resolve 'commweave.problems.workload:problem_<hex>' to the class `workload_for` made."""
    if name.startswith(PREFIX):
        return _workload_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
