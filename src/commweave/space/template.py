"""Workload templates: which directive values a workload's code generator implements, and the
rendering of a directive set into a candidate program text.

A template never silently approximates: a directive set it does not implement is rejected with the
reason ("gemm-allgather's template implements backend lsa only"), so the search learns the
template's reach instead of measuring the same program under many names. A rendered program
starts with one comment line holding its directive set (`DIRECTIVES_PREFIX` + JSON), so the text
alone says which strategy it claims.
"""

from __future__ import annotations

import functools
import json
from abc import ABC, abstractmethod
from typing import Any

from commweave.contracts.workload import Workload
from commweave.space.directives import DIMENSIONS, DirectiveSet, Space

DIRECTIVES_PREFIX = "# commweave-directives: "


def directives_header(ds: DirectiveSet) -> str:
    return DIRECTIVES_PREFIX + ds.to_json() + "\n"


def directives_of(text: str) -> DirectiveSet | None:
    """The directive set a program text claims (its header line), or None."""
    for line in text.splitlines():
        if line.startswith(DIRECTIVES_PREFIX):
            return DirectiveSet.from_json(line[len(DIRECTIVES_PREFIX):])
    return None


def program_body(text: str) -> str:
    """The text without its directive header: what actually runs (two sets that render the same
    body are the same program)."""
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith(DIRECTIVES_PREFIX))


class Template(ABC):
    """A workload's generator. `supported` maps a dimension (a directive or 'knob:<name>') to the
    values this template implements; dimensions missing from it are implemented for every value.
    The workload it renders for is passed in (`Workload.template()` does), never imported here."""

    #: the dimensions (directives, or 'knob:<name>') that change what a program does on one GPU,
    #: where there is nothing to communicate: at W = 1 the search holds every other dimension at
    #: the seed's value (`dimension_values`), so it spends its budget on what one GPU can show
    one_gpu_dimensions: tuple[str, ...] = ()

    def __init__(self, workload: Workload):
        self.workload = workload

    @functools.cached_property
    def seed_text(self) -> str:
        """The workload's seed program, the text templates render variants of (read once)."""
        return self.workload.program_text(self.workload.seed)

    @abstractmethod
    def space(self, world_size: int, capabilities: Any = None) -> Space:
        """This workload's ranges (chunk bytes, comm CTAs, tolerance) on this machine."""

    @abstractmethod
    def supported(self) -> dict[str, tuple[Any, ...]]:
        """Values implemented per dimension (knobs included as 'knob:<name>': their full domain)."""

    @abstractmethod
    def seed_directives(self) -> DirectiveSet:
        """The directive set the workload's seed program implements."""

    @abstractmethod
    def render_text(self, ds: DirectiveSet, shape: Any, world_size: int) -> str:
        """The program for a supported, valid set (without the header line)."""

    def unsupported(self, ds: DirectiveSet) -> list[str]:
        """Reasons this template cannot render `ds` (not a judgement of the strategy)."""
        why = []
        supported = self.supported()
        for dim in DIMENSIONS:
            if dim in supported and getattr(ds, dim) not in supported[dim]:
                allowed = supported[dim]
                what = f"{dim} {allowed[0]} only" if len(allowed) == 1 else f"{dim} in {', '.join(map(str, allowed))} only"
                why.append(f"{self.workload.name}'s template implements {what}, not {getattr(ds, dim)!r}")
        knobs = ds.knob_dict
        declared = {d[5:] for d in supported if d.startswith("knob:")}
        for name in sorted(set(knobs) | declared):
            if name not in declared:
                why.append(f"{self.workload.name}'s template has no knob {name!r}")
            elif name not in knobs:
                why.append(f"knob {name!r} is missing (values: {', '.join(map(repr, supported['knob:' + name]))})")
            elif knobs[name] not in supported["knob:" + name]:
                why.append(f"knob {name}={knobs[name]!r} is not one of {', '.join(map(repr, supported['knob:' + name]))}")
        return why

    def check(self, ds: DirectiveSet, world_size: int, capabilities: Any = None) -> list[str]:
        """Validity in this workload's space, then the template's reach; [] when renderable."""
        return ds.validate(self.space(world_size, capabilities)) + self.unsupported(ds)

    def render(self, ds: DirectiveSet, shape: Any, world_size: int, capabilities: Any = None) -> str:
        """A candidate program for `ds`; ValueError with every reason when it cannot be rendered."""
        why = self.check(ds, world_size, capabilities)
        if why:
            raise ValueError("cannot render this directive set: " + "; ".join(why))
        return directives_header(ds) + self.render_text(ds, shape, world_size)

    def dimension_values(self, world_size: int) -> dict[str, tuple[Any, ...]]:
        """The values a search may try per dimension: the space's, narrowed by `supported`; at
        W = 1 only `one_gpu_dimensions` vary, every other one keeps the seed's value."""
        space = self.space(world_size)
        supported = self.supported()
        out: dict[str, tuple[Any, ...]] = {}
        for dim in DIMENSIONS:
            values = space.values(dim)
            out[dim] = tuple(v for v in values if v in supported[dim]) if dim in supported else values
        for dim, values in supported.items():
            if dim.startswith("knob:"):
                out[dim] = tuple(values)
        if world_size == 1:
            seed = self.seed_directives()
            for dim in out:
                if dim not in self.one_gpu_dimensions:
                    out[dim] = (seed.get(dim),)
        return out

    def describe(self) -> str:
        return json.dumps({k: list(v) for k, v in self.supported().items()}, default=str)
