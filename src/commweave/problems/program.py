"""A `solution(*args)` file as a commweave program (contracts/program.py), and its program side.

`solution_program` wraps a solution's source (a problem's reference, or a candidate's) in the
program format: `setup` executes it as a module, `run` rebuilds the arguments from the judge's
input buffers (values.py: the tensors, the skeleton, the process groups the input maker made,
created again in this process's own group in the same order), calls `solution` on the judge's
own input tensors for the call (no copy: a reference may update its inputs in place, which a
problem's judge allows, `Workload.inputs_read_only`), and writes the flattened result into
`out`. The unpacking and the result's conversion are in every program's time alike. A skeleton that never changes with the seed comes once, in the shape
(workload.Layout.constant); only one that does is read back from the `args` input on every
call, and that read waits for the GPU. A plain `dist.new_group(ranks)` made inside a solution
returns the group first made for those ranks: group creation is a program's setup, and a
reference that makes its groups on every call (PKB #48) would otherwise time communicator
set-ups and, with NCCL, exhaust the GPU after a few hundred calls. `Bound` runs only in program
processes, beside the solution.
"""

from __future__ import annotations

import os
import sys
import tempfile
import types
from typing import Any

import torch

from commweave.contracts.workload import Shape
from commweave.problems.values import (ARGS, constant_key, rebuild_args, result_leaves, skeleton_from_bytes,
                                       unpack_skeleton, write_result)

PROGRAM = '''"""{what}, as a commweave program (commweave.problems.program)."""
from commweave.problems.program import Bound

# EVOLVE-BLOCK-START
SOLUTION = {source!r}


def setup(ctx, shape):
    return Bound(SOLUTION, ctx, shape)


def run(ctx, state, inputs, out):
    state.run(inputs, out)
# EVOLVE-BLOCK-END
'''


def solution_program(source: str, what: str) -> str:
    """The program that runs `source`'s solution(*args) on the judge's inputs."""
    return PROGRAM.format(what=what.replace('"', "'"), source=source)


class Bound:
    """A solution loaded in a program process, and the process groups its arguments name."""

    def __init__(self, source: str, ctx: Any, shape: Shape):
        import torch.distributed as dist

        self.groups: dict[tuple[int, ...] | None, Any] = {}
        self._make_group = dist.new_group
        dist.new_group = self._new_group  # this process runs one solution: its groups are ours to keep
        name = f"commweave_solution_{abs(hash(source))}"
        fd, path = tempfile.mkstemp(prefix="solution_", suffix=".py")  # TorchScript reads a function's source
        with os.fdopen(fd, "w") as f:
            f.write(source)
        module = types.ModuleType(name)
        module.__file__ = path
        sys.modules[name] = module  # dataclasses and pickling look modules up by name
        exec(compile(source, path, "exec"), module.__dict__)
        if not callable(getattr(module, "solution", None)):
            raise ValueError("the solution file defines no solution()")
        self.solution = module.solution
        self.ctx = ctx
        constant = shape.params.get(constant_key(ctx.rank))
        #: the skeleton every call gets, where it never changes with the seed: read from the shape
        #: once, not back from the GPU per call (that read waits for the judge's hold)
        self.constant = skeleton_from_bytes(bytes.fromhex(constant)) if isinstance(constant, str) else None

    def _new_group(self, ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        """dist.new_group, made once per rank list when called with the ranks alone."""
        if args or kwargs:
            return self._make_group(ranks, *args, **kwargs)
        key = tuple(int(r) for r in ranks) if ranks is not None else None
        if key not in self.groups:
            self.groups[key] = self._make_group(ranks)
        return self.groups[key]

    def _group(self, order: list[tuple[int, ...] | None], index: int | None) -> Any:
        """The group of the input maker's `index`: all of `order` are made (collectively, in order)
        the first time, then kept."""
        import torch.distributed as dist

        for key in order:
            self._new_group(list(key) if key is not None else None)
        return dist.group.WORLD if index is None else self.groups[order[index]]

    def run(self, inputs: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        skeleton, order = self.constant or unpack_skeleton(inputs[ARGS])
        args = rebuild_args(skeleton, inputs, lambda index: self._group(order, index))  # no leaf is named ARGS
        result = self.solution(*args)
        write_result(result_leaves(args if result is None else result), out)
