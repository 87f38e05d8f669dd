"""The offline proposer ($0): mutation and crossover of directives and template knobs, ranked by
the cost model and by what the database measured, steered away from what failed.

`Memory` is what the search learned: every directive set tried (never proposed again), the ones
that failed, a penalty per (dimension, value) a failing child introduced (weighted by how bad its
failure class is: a deadlock costs more than a compile error), and each value's measured effect
on log-fitness.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from commweave.evaluate.floor import MachineRates
from commweave.search.cost import predict_s
from commweave.space import DirectiveSet, Template
from commweave.contracts.workload import Cost

#: how strongly a failure class steers proposals away from the values that caused it
FAILURE_WEIGHT = {"timeout": 3.0, "illegal_address": 3.0, "wrong_result": 2.0, "nan": 2.0, "suspect": 2.0,
                  "runtime_error": 1.0, "compile_error": 1.0, "unavailable": 0.5}
ORDERED = {"comm_ctas", "chunk_bytes", "group_size", "knob:threads"}  # numeric: prefer neighbouring values
DEFAULT_GROUP_SIZE = 128  # TACO's: the group size compression switches on with


@dataclass
class Memory:
    tried: set[str] = field(default_factory=set)  # directive keys evaluated or in flight
    failed: dict[str, str] = field(default_factory=dict)  # directive key -> failure class
    penalty: dict[tuple[str, Any], float] = field(default_factory=lambda: defaultdict(float))
    _sums: dict[tuple[str, Any], list[float]] = field(default_factory=lambda: defaultdict(lambda: [0.0, 0]))
    _total: list[float] = field(default_factory=lambda: [0.0, 0])

    def record(self, ds: DirectiveSet, parent: DirectiveSet | None, fitness: float, failure: str | None) -> None:
        self.tried.add(ds.key)
        if failure is not None:
            self.failed[ds.key] = failure
            weight = FAILURE_WEIGHT.get(failure, 1.0)
            for dim in (ds.diff(parent) if parent is not None else []):
                self.penalty[(dim, _hashable(ds.get(dim)))] += weight
            return
        if fitness > 0:
            lf = math.log(fitness)
            self._total[0] += lf
            self._total[1] += 1
            for dim in ds.dimensions():
                cell = self._sums[(dim, _hashable(ds.get(dim)))]
                cell[0] += lf
                cell[1] += 1

    def effect(self, dim: str, value: Any) -> float:
        """Mean log-fitness of programs with this value minus the mean of all, shrunk towards 0."""
        cell = self._sums.get((dim, _hashable(value)))
        if not cell or not cell[1] or not self._total[1]:
            return 0.0
        n = cell[1]
        return (cell[0] / n - self._total[0] / self._total[1]) * n / (n + 2)


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@dataclass
class Proposal:
    directives: DirectiveSet
    changed: list[str]
    how: str  # "mutate k" | "crossover + mutate k" | "neighbour"
    score: float


class OfflineProposer:
    """Proposes a child of a parent directive set. Explore: several dimensions at once (with
    crossover); exploit: the best-ranked single-dimension neighbour."""

    name = "offline"
    cost_per_proposal = 0.0

    def __init__(self, template: Template, world_size: int, work: Cost, rates: MachineRates | None = None,
                 *, candidates: int = 48, cost_weight: float = 1.0, measured_weight: float = 2.0,
                 penalty_weight: float = 1.0, capabilities: Any = None):
        self.template = template
        self.world_size = world_size
        self.work = work
        self.rates = rates or MachineRates()
        self.capabilities = capabilities  # space.Capabilities (GIN) from the workers' probe; None: no GIN
        self.values = template.dimension_values(world_size)
        self.dims = [d for d, v in self.values.items() if len(v) > 1]
        self.candidates = candidates
        self.cost_weight, self.measured_weight, self.penalty_weight = cost_weight, measured_weight, penalty_weight

    def predict_s(self, ds: DirectiveSet) -> float:
        return predict_s(ds, self.work, self.world_size, self.rates)

    def _step(self, dim: str, current: Any, rng: random.Random) -> Any:
        values = self.values[dim]
        if dim in ORDERED and current in values and rng.random() < 0.7:
            i = values.index(current)
            near = [values[j] for j in (i - 1, i + 1) if 0 <= j < len(values)]
            return rng.choice(near)
        others = [v for v in values if v != current]
        return rng.choice(others) if others else current

    def with_value(self, ds: DirectiveSet, dim: str, value: Any) -> DirectiveSet:
        """ds with dim = value, and the dimension tied to it kept consistent: compression and
        group_size switch on and off together (a format needs a group size, none needs 0), so one
        move can turn compression on (a single-dimension step never could)."""
        changes = {dim: value}
        if dim == "compression":
            if value == "none":
                changes["group_size"] = 0
            elif ds.get("group_size") == 0:
                sizes = [g for g in self.values.get("group_size", ()) if g]
                changes["group_size"] = DEFAULT_GROUP_SIZE if DEFAULT_GROUP_SIZE in sizes or not sizes else sizes[0]
        elif dim == "group_size" and (value == 0) != (ds.get("compression") == "none"):
            formats = [c for c in self.values.get("compression", ()) if c != "none"]
            changes["compression"] = "none" if value == 0 or not formats else formats[0]
        return ds.with_(**changes)

    def mutate(self, ds: DirectiveSet, k: int, rng: random.Random) -> DirectiveSet:
        for dim in rng.sample(self.dims, min(k, len(self.dims))):
            ds = self.with_value(ds, dim, self._step(dim, ds.get(dim), rng))
        return ds

    def crossover(self, a: DirectiveSet, b: DirectiveSet, rng: random.Random) -> DirectiveSet:
        return a.with_(**{dim: b.get(dim) for dim in self.dims if rng.random() < 0.5 and dim in b.dimensions()})

    def score(self, child: DirectiveSet, parent: DirectiveSet, memory: Memory) -> float:
        changed = child.diff(parent)
        gain = math.log(self.predict_s(parent) / self.predict_s(child))
        measured = sum(memory.effect(d, child.get(d)) - memory.effect(d, parent.get(d)) for d in changed)
        penalty = sum(memory.penalty.get((d, _hashable(child.get(d))), 0.0) for d in changed)
        return self.cost_weight * gain + self.measured_weight * measured - self.penalty_weight * penalty

    def _admissible(self, ds: DirectiveSet, memory: Memory, exclude: set[str]) -> bool:
        return ds.key not in memory.tried and ds.key not in exclude and not self.template.check(ds, self.world_size,
                                                                                           self.capabilities)

    def propose(self, parent: DirectiveSet, phase: str, memory: Memory, rng: random.Random,
                other: DirectiveSet | None = None, exclude: set[str] = frozenset()) -> Proposal | None:
        """A new, valid, renderable, untried child of `parent`, or None if none could be found."""
        pool: dict[str, tuple[DirectiveSet, str]] = {}
        if phase == "exploit":
            for dim in self.dims:
                for value in self.values[dim]:
                    child = self.with_value(parent, dim, value)
                    if child != parent and self._admissible(child, memory, exclude):
                        pool[child.key] = (child, "neighbour")
        if not pool:  # explore, or every neighbour is tried: jump further
            for _ in range(self.candidates * 4):
                k = rng.randint(2, 4)
                if other is not None and rng.random() < 0.3:
                    child, how = self.mutate(self.crossover(parent, other, rng), k - 1, rng), f"crossover + mutate {k - 1}"
                else:
                    child, how = self.mutate(parent, k, rng), f"mutate {k}"
                if self._admissible(child, memory, exclude):
                    pool[child.key] = (child, how)
                if len(pool) >= self.candidates:
                    break
        if not pool:
            return None
        temperature = 0.5 if phase == "explore" else 0.05
        best = max(pool.values(), key=lambda c: self.score(c[0], parent, memory) + temperature * rng.gauss(0, 1))
        child, how = best
        return Proposal(child, child.diff(parent), how, self.score(child, parent, memory))
