"""A simulated evaluator: a known fitness landscape over a template's directive space.

It reads the directive set a rendered program claims (its header line) and returns an
`EvalResult` shaped exactly like the real Evaluator's: fitness = peak x decay^(distance to the
optimum), where the distance counts steps along ordered dimensions (comm CTAs, chunk bytes,
threads) and 1 per differing categorical dimension; rules can make chosen sets fail with any
failure class. What runs is the text: a program's literal `CONFIG = dict(...)` entries for
`backend`, `comm_ctas` and the set's knobs override what its header claims (a rendered program's
agree with it; an LLM's edit of CONFIG changes the simulated fitness). It lets the search (selection, phases, failure memory, migration, resume, report)
be tested and demonstrated on a CPU, where the optimum is known.
"""

from __future__ import annotations

import ast
import random
import time
from pathlib import Path
from typing import Any, Callable

from commweave.contracts.result import EvalResult, ProgramTiming
from commweave.contracts.program import python_ast
from commweave.contracts.verdict import FailureClass, Verdict
from commweave.space import DirectiveSet, Template, directives_of

Rule = Callable[[DirectiveSet], "FailureClass | str | None"]
ORDERED = ("comm_ctas", "chunk_bytes", "group_size", "knob:threads")


class SimulatedEvaluator:
    def __init__(self, template: Template, world_size: int, optimum: DirectiveSet, *, peak: float = 2.0,
                 decay: float = 0.85, rules: list[Rule] = (), baseline_us: float = 1000.0, noise: float = 0.0,
                 delay_s: float = 0.0, log: str | Path | None = None, seed: int = 0):
        self.template, self.world_size, self.optimum = template, world_size, optimum
        self.values = template.dimension_values(world_size)
        self.peak, self.decay, self.rules = peak, decay, list(rules)
        self.baseline_us, self.noise, self.delay_s = baseline_us, noise, delay_s
        self.log = Path(log) if log else None
        self.rng = random.Random(seed)
        self.calls = 0
        self.workload = template.workload

    def distance(self, ds: DirectiveSet) -> float:
        total = 0.0
        for dim in self.optimum.dimensions():
            a, b = ds.get(dim), self.optimum.get(dim)
            if a == b:
                continue
            values = self.values.get(dim, ())
            if dim in ORDERED and a in values and b in values:
                total += abs(values.index(a) - values.index(b))
            else:
                total += 1
        return total

    def fitness(self, ds: DirectiveSet) -> float:
        return self.peak * self.decay ** self.distance(ds)

    @staticmethod
    def running(text: str, ds: DirectiveSet) -> DirectiveSet:
        """`ds` with the values the program's literal CONFIG sets for backend, comm_ctas and its knobs."""
        try:
            tree = python_ast(text)
        except SyntaxError:
            return ds
        call = next((n.value for n in tree.body if isinstance(n, ast.Assign) and len(n.targets) == 1
                     and isinstance(n.targets[0], ast.Name) and n.targets[0].id == "CONFIG"), None)
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "dict"):
            return ds
        changes = {}
        for kw in call.keywords:
            name = kw.arg if kw.arg in ("backend", "comm_ctas") else f"knob:{kw.arg}" if kw.arg in ds.knob_dict else None
            if name is not None:
                try:
                    changes[name] = ast.literal_eval(kw.value)
                except ValueError:
                    continue
        return ds.with_(**changes)

    def compile_source(self, source: str) -> None:
        """No nvcc: the simulation measures nothing a compile could change."""

    def evaluate(self, text: str, shape: Any) -> EvalResult:
        self.calls += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        ds = directives_of(text)
        label = str(shape)
        baseline = ProgramTiming("host", Verdict.passed(), self.baseline_us, self.baseline_us, self.baseline_us)
        floor = self.baseline_us / (self.peak * 1.25)
        if ds is None:
            result = EvalResult(0.0, Verdict.failed(FailureClass.RUNTIME_ERROR, "no directive header"), label)
        else:
            runs = self.running(text, ds)
            failure = next((f for f in (rule(runs) for rule in self.rules) if f), None)
            if failure:
                verdict = Verdict.failed(FailureClass(failure), f"simulated {FailureClass(failure)}", shape=label)
                result = EvalResult(0.0, verdict, label, None, None, {"host": baseline}, floor)
            else:
                fit = self.fitness(runs) * (1 + self.noise * self.rng.gauss(0, 1))
                us = self.baseline_us / fit
                timing = ProgramTiming("candidate", Verdict.passed(), us, us, us)
                result = EvalResult(fit, Verdict.passed("simulated"), label, timing, "host", {"host": baseline}, floor)
        if self.log is not None and ds is not None:
            with self.log.open("a") as f:
                f.write(ds.key + "\n")
                f.flush()
        return result


def demo_evaluator(template: Template, world_size: int, seed: int) -> SimulatedEvaluator:
    """`commweave demo`'s simulated evaluator, for any template: the optimum sits mid-range on every ordered
    dimension (comm CTAs, chunk bytes, threads) of the seed's directive set; the most comm CTAs
    time out and the smallest chunks fault, so the search meets failures as a real one does."""
    values = template.dimension_values(world_size)
    ordered = {dim: values[dim] for dim in ORDERED if len(values.get(dim, ())) > 1}
    optimum = template.seed_directives().with_(**{dim: vals[len(vals) // 2] for dim, vals in ordered.items()})
    rules = []
    if "comm_ctas" in ordered:
        rules.append(lambda ds: "timeout" if ds.get("comm_ctas") == ordered["comm_ctas"][-1] else None)
    if "chunk_bytes" in ordered:
        rules.append(lambda ds: "illegal_address" if ds.get("chunk_bytes") == ordered["chunk_bytes"][0] else None)
    return SimulatedEvaluator(template, world_size, optimum, rules=rules, noise=0.01, seed=seed)
