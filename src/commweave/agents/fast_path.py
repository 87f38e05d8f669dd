"""The fast-path agent: a host-driven program in, a correct device-initiated program out.

Two stages, each a bounded loop of attempts judged by the cascade:

- A: the model rewrites the input as a candidate program that keeps its host collectives and adds
  the device infrastructure (symmetric buffers, windows, a device communicator); it must pass.
- B: the model replaces the host collectives with device-initiated code under the conservative
  directive set (CTA issuer, deferred placement, global barrier, coarse chunks); it must pass, and
  no host collective may remain (checked statically, before the cascade runs).

A failure the cascade reports goes to a judge (a separate call, purpose "judge") that diagnoses
it without prescribing API calls; the diagnosis and the failure go into the next attempt's
prompt. An answer without a usable program, or a failed LLM call, is a failed attempt whose error
is fed back as it is. Every attempt is recorded (stage, verdict, diagnosis, tokens, cost).

With no LLM configured, the fast path renders the workload's template at the conservative
directive set (or, where the template does not implement it, at the nearest set it does, saying
which and why) and runs the cascade on that.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from commweave.agents.analysis import ProgramAnalysis, analyze_program, analyze_source, language_of
from commweave.agents.prompts import (
    JUDGE_SYSTEM, REWRITE_SYSTEM, Feedback, WorkloadFacts, judge_prompt, rewrite_prompt,
)
from commweave.contracts.result import EvalResult
from commweave.contracts.verdict import Verdict
from commweave.llm import BudgetExceeded, LLMClient, LLMError, Message, PatchError, extract_code
from commweave.space import DirectiveSet, Space, Template, directives_header, program_body
from commweave.contracts.workload import Shape, Workload

DEFAULT_ATTEMPTS = 3
REWRITE_TEMPERATURE = 0.2  # correctness first: little variety between attempts
JUDGE_TEMPERATURE = 0.0
#: the placements and sync scopes tried, most conservative first, when a template cannot render
#: the conservative set itself
_PLACEMENTS = ("deferred", "split", "fused")
_SYNCS = ("global", "peer", "chunk")


class FastPathError(ValueError):
    """The fast path cannot start (no template and no LLM, an input of the wrong kind, ...)."""


class ProgramJudge(Protocol):
    """What the fast path needs of an evaluator: the real `Evaluator` has all three."""

    def compile(self, text: str) -> Verdict: ...

    def check(self, text: str) -> Verdict: ...

    def evaluate(self, text: str, shape: Shape) -> EvalResult: ...


def conservative_directives(template: Template | None, world_size: int) -> DirectiveSet:
    """The conservative strategy: LSA stores issued by whole CTAs, all communication before the
    computation (placement deferred), one global barrier, the coarsest chunks of the space. The
    template, when there is one, gives the space and its seed's comm CTAs; template knobs are left
    out (they are the template's, not a strategy a model writes to)."""
    space = template.space(world_size) if template is not None else Space()
    comm_ctas = template.seed_directives().comm_ctas if template is not None else DirectiveSet().comm_ctas
    ds = DirectiveSet.make(backend="lsa", placement="deferred", sync="global", issuer="cta", comm_ctas=comm_ctas,
                           chunk_bytes=space.chunk_bytes_max, compression="none", group_size=0, language="cuda")
    why = ds.validate(space)
    if why:
        raise FastPathError(f"the conservative directive set is not valid here: {'; '.join(why)}")
    return ds


def renderable_conservative(template: Template, world_size: int) -> tuple[DirectiveSet, str]:
    """The conservative set (with the seed's template knobs) if the template renders it, else the
    nearest set it does (placement and sync relaxed in order deferred > split > fused, global > peer > chunk), and a sentence
    saying what was relaxed and why ("" when nothing was)."""
    wanted = conservative_directives(template, world_size).with_(knobs=template.seed_directives().knob_dict)
    reasons = template.check(wanted, world_size)
    if not reasons:
        return wanted, ""
    for placement in _PLACEMENTS:
        for sync in _SYNCS:
            ds = wanted.with_(placement=placement, sync=sync)
            if not template.check(ds, world_size):
                changed = ", ".join(f"{d} {ds.get(d)}" for d in wanted.diff(ds))
                return ds, (f"the template cannot render the conservative set ({'; '.join(reasons)}); "
                            f"rendered the nearest it implements: {changed}")
    raise FastPathError(f"{template.workload.name}'s template renders no conservative set: {'; '.join(reasons)}")


@dataclass
class Attempt:
    """One attempt of a stage, as recorded in the result and the attempt log."""

    stage: str  # "input" (the input program's own check), "A", "B", or "template" (no LLM)
    attempt: int
    ok: bool
    failure: str | None  # a failure class, "parse_error", "host_collectives", "llm_error", "budget"
    message: str
    detail: str = ""  # a traceback or compiler output
    diagnosis: str = ""
    input_tokens: int = 0  # the rewrite's and the judge's calls together
    output_tokens: int = 0
    cost_usd: float = 0.0
    program: str | None = None
    response: str = ""  # the model's raw answer

    @classmethod
    def of_verdict(cls, stage: str, attempt: int, verdict: Verdict, program: str) -> Attempt:
        return cls(stage, attempt, verdict.ok, None if verdict.ok else str(verdict.failure), verdict.message,
                   verdict.detail, program=program)


@dataclass
class FastPathResult:
    """The outcome: the final program when `ok`, and every attempt on the way."""

    ok: bool
    program: str | None
    stage: str  # where it ended: "B" (or "template") when ok, else the stage that failed
    message: str
    directives: DirectiveSet
    model: str | None  # the LLM's name; None on the template path
    analysis: ProgramAnalysis
    attempts: list[Attempt] = field(default_factory=list)
    evaluation: dict[str, Any] | None = None  # the final program benchmarked beside the baselines

    @property
    def input_tokens(self) -> int:
        return sum(a.input_tokens for a in self.attempts)

    @property
    def output_tokens(self) -> int:
        return sum(a.output_tokens for a in self.attempts)

    @property
    def cost_usd(self) -> float:
        return sum(a.cost_usd for a in self.attempts)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "stage": self.stage, "message": self.message, "model": self.model,
                "directives": self.directives.to_dict(), "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "cost_usd": self.cost_usd, "evaluation": self.evaluation,
                "analysis": self.analysis.to_dict(), "attempts": [asdict(a) for a in self.attempts],
                "program": self.program}

    def write(self, out: Path) -> tuple[Path | None, Path]:
        """The program to `out` (when ok) and the attempt log beside it, `<stem>.attempts.json`."""
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        log = attempt_log_path(out)
        log.write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        if self.ok and self.program is not None:
            out.write_text(self.program)
            return out, log
        return None, log


def attempt_log_path(out: Path) -> Path:
    return Path(out).with_name(Path(out).stem + ".attempts.json")


class _Stop(Exception):
    """The LLM budget is spent: the run ends cleanly with what it has."""


class FastPath:
    """Converts one host-driven program for one workload on one evaluator."""

    def __init__(self, workload: Workload, evaluator: ProgramJudge, client: LLMClient | None = None, *,
                 world_size: int, attempts: int = DEFAULT_ATTEMPTS, require_device_initiated: bool = True,
                 log: Callable[[str], None] | None = None):
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1 per stage, got {attempts}")
        self.workload = workload
        self.evaluator = evaluator
        self.client = client
        self.world_size = world_size
        self.attempts = attempts
        #: stage B must leave no host collective; off only where no device exists (CPU dry runs)
        self.require_device_initiated = require_device_initiated
        self.log = log or (lambda line: None)
        self._template: Template | None = None
        try:
            self._template = workload.template()
        except LookupError:
            pass

    # -- entry ----------------------------------------------------------------------------------
    def run(self, program: Path | str, bench_shape: Shape | None = None) -> FastPathResult:
        """Convert the program at `program`; benchmark the result at `bench_shape` when given."""
        path = Path(program)
        analysis = analyze_program(path)  # AnalysisError for the wrong kind of file or no collective
        if self.client is None:
            result = self._from_template(analysis, bench_shape)
        else:
            result = self._with_llm(path, analysis)
        if result.ok and bench_shape is not None:
            self._benchmark(result, bench_shape)
        return result

    # -- no LLM ---------------------------------------------------------------------------------
    def _from_template(self, analysis: ProgramAnalysis, shape: Shape | None) -> FastPathResult:
        if self._template is None:
            raise FastPathError(f"no LLM is configured and workload {self.workload.name!r} has no template to "
                                "instantiate: give a model with --llm (see the README's LLM section)")
        ds, relaxed = renderable_conservative(self._template, self.world_size)
        shape = shape or self._template.default_shape(self.world_size)
        text = self._template.render(ds, shape, self.world_size)
        how = (f"no LLM configured: instantiated {self.workload.name}'s template at the conservative directive set"
               + (f" ({relaxed})" if relaxed else "") + "; the input program was analysed, not rewritten")
        self.log(how)
        verdict = self.evaluator.check(text)
        attempt = Attempt.of_verdict("template", 1, verdict, text)
        self.log(_line(attempt))
        message = how + (f"; the cascade passed: {verdict.message}" if verdict.ok else
                         f"; the cascade failed: {verdict.failure}: {verdict.message}")
        return FastPathResult(verdict.ok, text if verdict.ok else None, "template", message, ds, None, analysis,
                              [attempt])

    # -- with an LLM ----------------------------------------------------------------------------
    def _with_llm(self, path: Path, analysis: ProgramAnalysis) -> FastPathResult:
        assert self.client is not None
        ds = conservative_directives(self._template, self.world_size)
        facts = WorkloadFacts.of(self.workload, self.world_size)
        text = path.read_text()
        language = language_of(path)
        result = FastPathResult(False, None, "input", "", ds, self.client.name, analysis)
        if language == "python":  # a CUDA file cannot run in the harness as it is
            verdict = self.evaluator.check(text)
            result.attempts.append(Attempt.of_verdict("input", 0, verdict, text))
            self.log(_line(result.attempts[-1]))
            if not verdict.ok:
                result.message = (f"the input program fails the cascade for {self.workload.name!r}: {verdict.failure}: "
                                  f"{verdict.message} (the fast path converts a correct host-driven program)")
                return result
        try:
            stage_a = self._stage("A", facts, analysis, text, language, None, result)
            if stage_a is None:
                result.stage, result.message = "A", f"stage A found no passing program in {self.attempts} attempts"
                return result
            stage_a_analysis = analyze_source(stage_a, "python", "the stage A program")  # its collectives, by line
            stage_b = self._stage("B", facts, stage_a_analysis, stage_a, "python", ds, result)
        except _Stop as stop:
            result.message = str(stop)
            return result
        if stage_b is None:
            result.stage, result.message = "B", f"stage B found no passing program in {self.attempts} attempts"
            return result
        result.ok, result.stage, result.program = True, "B", stage_b
        tries = sum(a.stage in ("A", "B") for a in result.attempts)
        result.message = (f"converted in {tries} attempts; "
                          f"${result.cost_usd:.4f}, {result.input_tokens} + {result.output_tokens} tokens")
        return result

    def _stage(self, stage: str, facts: WorkloadFacts, analysis: ProgramAnalysis, start: str, language: str,
               ds: DirectiveSet | None, result: FastPathResult) -> str | None:
        """Up to `attempts` rewrites of `start`; the first passing program, or None."""
        feedback: Feedback | None = None
        for n in range(1, self.attempts + 1):
            result.stage = stage
            prompt = rewrite_prompt(stage, self.workload.name, facts, analysis, start, language, ds, feedback)
            attempt = self._attempt(stage, n, prompt, ds)
            result.attempts.append(attempt)
            last = n == self.attempts
            if attempt.ok:
                self.log(_line(attempt))
                return attempt.program
            if attempt.failure not in ("parse_error", "host_collectives", "llm_error") and not last:
                attempt.diagnosis = self._judge(stage, facts, attempt)
            self.log(_line(attempt))
            if attempt.failure != "llm_error":  # an unreachable model teaches the next attempt nothing
                message = attempt.message + (f"\n{attempt.detail}" if attempt.detail else "")
                feedback = Feedback(n, attempt.failure or "", message, attempt.program, attempt.diagnosis)
        return None

    def _attempt(self, stage: str, n: int, prompt: str, ds: DirectiveSet | None) -> Attempt:
        """One rewrite: the call, the program from the answer, the static check, the cascade."""
        try:
            completion = self._complete(prompt, REWRITE_SYSTEM, REWRITE_TEMPERATURE, "fast_path")
        except LLMError as exc:
            return Attempt(stage, n, False, "llm_error", f"the model could not be reached: {exc}")
        attempt = Attempt(stage, n, False, None, "", input_tokens=completion.input_tokens,
                          output_tokens=completion.output_tokens, cost_usd=completion.cost_usd,
                          response=completion.text)
        try:
            program = extract_code(completion.text, "python")
        except PatchError as exc:
            attempt.failure, attempt.message = "parse_error", f"the answer could not be used: {exc}"
            return attempt
        if ds is not None:
            program = directives_header(ds) + program_body(program)
        attempt.program = program
        if stage == "B" and self.require_device_initiated:
            remaining = self._host_collectives(program)
            if remaining:
                attempt.failure = "host_collectives"
                attempt.message = ("stage B must replace every host collective, but the program still has "
                                   + "; ".join(remaining))
                return attempt
        verdict = self.evaluator.check(program)
        attempt.ok, attempt.message, attempt.detail = verdict.ok, verdict.message, verdict.detail
        attempt.failure = None if verdict.ok else str(verdict.failure)
        return attempt

    @staticmethod
    def _host_collectives(program: str) -> list[str]:
        try:
            found = analyze_source(program, "python", "stage B").collectives
        except ValueError:
            return []  # unparsable: the cascade reports it as a compile error
        return [f"{c.name} at line {c.line}" for c in found]

    def _judge(self, stage: str, facts: WorkloadFacts, attempt: Attempt) -> str:
        """The judge's diagnosis of a failed attempt ("" if the call failed; its tokens and cost
        count to the attempt)."""
        assert attempt.program is not None
        prompt = judge_prompt(stage, facts, attempt.program, attempt.failure or "", attempt.message, attempt.detail)
        try:
            completion = self._complete(prompt, JUDGE_SYSTEM, JUDGE_TEMPERATURE, "judge")
        except LLMError as exc:
            self.log(f"stage {stage} attempt {attempt.attempt}: the judge could not be reached ({exc}); "
                     "the next attempt gets the failure alone")
            return ""
        attempt.input_tokens += completion.input_tokens
        attempt.output_tokens += completion.output_tokens
        attempt.cost_usd += completion.cost_usd
        return completion.text.strip()

    def _complete(self, prompt: str, system: str, temperature: float, purpose: str):
        assert self.client is not None
        try:
            return self.client.complete([Message("user", prompt)], system=system, temperature=temperature,
                                        purpose=purpose)
        except BudgetExceeded as exc:
            raise _Stop(f"the LLM budget is spent ({exc}); stopped cleanly") from exc

    # -- benchmark ------------------------------------------------------------------------------
    def _benchmark(self, result: FastPathResult, shape: Shape) -> None:
        """The final program checked on `shape` too and timed beside the workload's baselines
        (needs the real Evaluator's `evaluate`)."""
        assert result.program is not None
        ev = self.evaluator.evaluate(result.program, shape)
        result.evaluation = {
            "shape": ev.shape, "fitness": ev.fitness, "baseline": ev.baseline, "verdict": asdict(ev.verdict),
            "median_us": ev.candidate.median_us if ev.candidate is not None else None,
            "baselines_us": {n: t.median_us for n, t in ev.baselines.items()}, "floor_us": ev.floor_us,
        }
        if not ev.verdict.ok:
            result.ok = False
            result.message += f"; but the benchmark at {shape} failed it: {ev.verdict.failure}: {ev.verdict.message}"
        elif ev.baseline is not None:
            result.message += f"; {ev.fitness:.2f}x over {ev.baseline} at {shape}"
        self.log(f"benchmark at {shape}: " + (f"{ev.fitness:.2f}x over {ev.baseline}" if ev.verdict.ok else
                                              f"{ev.verdict.failure}: {ev.verdict.message}"))


def _line(attempt: Attempt) -> str:
    what = "passed" if attempt.ok else f"{attempt.failure}: {attempt.message.splitlines()[0] if attempt.message else ''}"
    label = "input program" if attempt.stage == "input" else (
        "template" if attempt.stage == "template" else f"stage {attempt.stage} attempt {attempt.attempt}")
    return f"{label}: {what}" + (" (judge: diagnosis recorded)" if attempt.diagnosis else "")
