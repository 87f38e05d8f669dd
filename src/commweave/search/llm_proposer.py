"""The LLM slow-path proposer: a model writes a child of a parent program.

One proposal: the search (main thread) picks the parent, a patch type and temperature for the
phase (`PHASES`), inspirations and recent failures, into a `Request`; a model then answers (any
thread, `LLMProposer.write`) with the directive set it targets in a ```json block, validated
against the workload's space, followed by the patch:

- `diff`: SEARCH/REPLACE edits confined to the EVOLVE-BLOCKs (`commweave.llm.apply_diff`);
- `full`: the whole program rewritten, only the EVOLVE-BLOCKs may differ (`apply_rewrite`);
- `crossover`: the parent and a second good program combined into one full rewrite.

An answer that cannot be used (no or bad JSON, invalid directives, a diff that does not apply,
markers removed, edits outside the blocks, no code, a syntax error, no change) is sent back with
the reason, at most `max_resamples` times; each one is recorded through `on_unusable`. A call
that fails after the client's retries (429, 5xx, timeout) or the spent budget ends the proposal
with that error's kind as its outcome: the search skips it, nothing raises.

The child's text is the parent's body with the patch applied, under a directive header naming the
set the model stated (not a template rendering: the model may write code no template foresaw).
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from commweave.evaluate.floor import MachineRates, floor_s
from commweave.contracts.program import python_code
from commweave.llm import (BudgetExceeded, CallRecord, LLMClient, LLMError, Message, PatchError, apply_diff,
                           apply_rewrite, extract_json_block)
from commweave.search import prompts
from commweave.search.db import ProgramDB, ProgramRecord
from commweave.space import DirectiveSet, Template, directives_header, program_body

PATCH_TYPES = ("diff", "full", "crossover")


@dataclass(frozen=True)
class PhasePolicy:
    mix: Mapping[str, float]  # patch type -> weight
    temperature: float


#: explore rewrites more (whole programs, combinations) and samples hotter; exploit makes small
#: edits to the island's best, cold
PHASES: dict[str, PhasePolicy] = {
    "explore": PhasePolicy({"diff": 0.4, "full": 0.3, "crossover": 0.3}, temperature=1.0),
    "exploit": PhasePolicy({"diff": 0.8, "full": 0.1, "crossover": 0.1}, temperature=0.3),
}


@dataclass(frozen=True)
class Request:
    """What one proposal needs, gathered on the search's thread."""

    parent: ProgramRecord
    phase: str
    patch: str
    temperature: float
    inspirations: tuple[ProgramRecord, ...]
    failures: tuple[ProgramRecord, ...]
    meta_summary: str
    partner: ProgramRecord | None = None  # crossover's second program
    meta_prompt: str | None = None  # set when this proposal first asks the model for a new meta-summary


@dataclass(frozen=True)
class LLMProposal:
    """A model's child, or why there is none."""

    model: str
    patch: str
    outcome: str  # "ok" | "malformed" (every sample unusable) | an LLMError kind ("timeout", "budget", ...)
    text: str | None
    directives: DirectiveSet | None
    cost_usd: float  # the proposal's completions (the meta call's cost is not the child's)
    samples: int  # answers received
    message: str  # the last parse or call error; "" when ok
    meta_summary: str | None = None  # the new summary, when the request asked for one and got it


class Malformed(Exception):
    """An answer the search cannot use; `kind` classifies it (PatchError kinds, 'invalid_directives',
    'syntax', 'unchanged')."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


class LLMProposer:
    """Writes prompts, parses answers, resamples unusable ones. Holds no model: the caller picks
    the client (a `ModelPool`'s choice) for each proposal."""

    def __init__(self, template: Template, world_size: int, shape: Any, *,
                 rates: MachineRates | None = None, hardware: Mapping[str, Any] | None = None, capabilities: Any = None,
                 max_resamples: int = 2, on_unusable: Callable[[str, str, str], None] | None = None,
                 phases: Mapping[str, PhasePolicy] = PHASES):
        workload = template.workload
        self.space = template.space(world_size, capabilities)
        knobs = {k[5:]: v for k, v in template.supported().items() if k.startswith("knob:")}
        cost = workload.cost(shape, world_size)
        measured = rates is not None
        rates = rates or MachineRates()
        self.context = (prompts.task(workload.name, workload.summary, shape, world_size, workload.baselines[0])
                        + "\n" + prompts.design_space(self.space, knobs)
                        + "\n" + prompts.hardware(rates, measured, cost, floor_s(cost, rates), dict(hardware or {})))
        self.max_resamples = max_resamples
        self.on_unusable = on_unusable  # (model, outcome 'malformed:<kind>', message)
        self.phases = phases

    # -- the search's side ----------------------------------------------------------------------
    def request(self, parent: ProgramRecord, phase: str, rng: random.Random, inspirations: list[ProgramRecord],
                failures: list[ProgramRecord], meta_summary: str = "", meta_prompt: str | None = None) -> Request:
        """The patch type and temperature for the phase; crossover's partner is an inspiration
        (without one, a full rewrite)."""
        policy = self.phases[phase]
        patch = rng.choices(list(policy.mix), weights=list(policy.mix.values()))[0]
        partner = rng.choice(inspirations) if patch == "crossover" and inspirations else None
        if patch == "crossover" and partner is None:
            patch = "full"
        return Request(parent, phase, patch, policy.temperature, tuple(inspirations), tuple(failures), meta_summary,
                       partner, meta_prompt)

    def prompt(self, request: Request, meta_summary: str | None = None) -> str:
        parts = [self.context,
                 prompts.program("Parent program", request.parent),
                 prompts.inspirations(request.parent, request.inspirations),
                 prompts.failures(request.failures),
                 prompts.meta_summary(request.meta_summary if meta_summary is None else meta_summary),
                 prompts.answer(request.patch, request.partner)]
        if request.partner is not None:
            parts.append(prompts.program(f"Program #{request.partner.id} (to combine with the parent)", request.partner))
        return "\n".join(parts)

    # -- the model's side (any thread) ----------------------------------------------------------
    def directives(self, answer: str, parent: ProgramRecord) -> DirectiveSet:
        """The answer's ```json directive set, keys it leaves out taken from the parent's."""
        try:
            stated = extract_json_block(answer)
        except PatchError as exc:
            raise Malformed(exc.kind, exc.message) from None
        knobs = stated.get("knobs", {})
        if not isinstance(knobs, dict):
            raise Malformed("invalid_directives", f"'knobs' must be an object of name: value, not {knobs!r}")
        merged = {**(parent.directives or {}), **stated, "knobs": {**(parent.directives or {}).get("knobs", {}), **knobs}}
        try:
            ds = DirectiveSet.from_dict(merged)
            why = ds.validate(self.space)
        except (TypeError, ValueError) as exc:
            raise Malformed("invalid_directives", str(exc)) from None
        if why:
            raise Malformed("invalid_directives", "the directive set is not valid here: " + "; ".join(why))
        return ds

    def child(self, answer: str, request: Request) -> tuple[str, DirectiveSet]:
        """The child program (directive header + patched body) and its directive set; Malformed
        when the answer cannot be used."""
        ds = self.directives(answer, request.parent)
        body = program_body(request.parent.code)
        try:
            new = apply_diff(body, answer) if request.patch == "diff" else apply_rewrite(body, answer)
        except PatchError as exc:
            raise Malformed(exc.kind, exc.message) from None
        if new == body:
            raise Malformed("unchanged", "the program is the parent's, unchanged; change the code your strategy needs")
        try:
            python_code(new, "<candidate>")
        except (SyntaxError, ValueError) as exc:
            where = f" at line {exc.lineno}" if isinstance(exc, SyntaxError) else ""
            raise Malformed("syntax", f"the program does not parse{where}: {getattr(exc, 'msg', exc)}") from None
        return directives_header(ds) + new, ds

    def write(self, client: LLMClient, request: Request) -> LLMProposal:
        """Ask `client` for a child (the meta-summary first when the request asks for one); never
        raises for a model's failure or a bad answer."""
        summary = None
        if request.meta_prompt is not None:
            try:
                summary = self.summarise(client, request.meta_prompt)
            except BudgetExceeded as exc:
                return LLMProposal(client.name, request.patch, exc.kind, None, None, 0.0, 0, exc.message)
            except LLMError:
                pass  # its attempts are in the ledger; the proposal goes on with the old summary
        messages = [Message("user", self.prompt(request, summary))]
        cost, message = 0.0, ""
        for sample in range(1 + self.max_resamples):
            try:
                completion = client.complete(messages, system=prompts.SYSTEM, temperature=request.temperature,
                                             purpose="propose")
            except LLMError as exc:
                return LLMProposal(client.name, request.patch, exc.kind, None, None, cost, sample, exc.message, summary)
            cost += completion.cost_usd
            try:
                text, ds = self.child(completion.text, request)
            except Malformed as exc:
                if self.on_unusable is not None:
                    self.on_unusable(client.name, f"malformed:{exc.kind}", exc.message)
                message = f"{exc.kind}: {exc.message}"
                messages += [Message("assistant", completion.text), Message("user", prompts.resample(exc.kind, exc.message))]
                continue
            return LLMProposal(client.name, request.patch, "ok", text, ds, cost, sample + 1, "", summary)
        return LLMProposal(client.name, request.patch, "malformed", None, None, cost, 1 + self.max_resamples, message,
                           summary)

    def summarise(self, client: LLMClient, meta_prompt: str) -> str:
        """The meta call: what worked so far, in the model's words (LLMError on failure)."""
        completion = client.complete([Message("user", meta_prompt)], system=prompts.SYSTEM, temperature=0.3,
                                     purpose="meta")
        return completion.text.strip()


class CallLog:
    """Writes LLM calls into the run database from whichever thread makes them (the Ledger's
    `on_call`), and remembers per thread the proposal rows written since `start()`, so they can be
    linked to the program the proposal produced (a meta call made on the way is not linked)."""

    def __init__(self, db: ProgramDB):
        self.db = db
        self._local = threading.local()

    def start(self) -> None:
        self._local.rows = []

    def collect(self) -> list[int]:
        rows = getattr(self._local, "rows", None) or []
        self._local.rows = None
        return rows

    def call(self, rec: CallRecord) -> None:
        self._add(model=rec.model, purpose=rec.purpose, outcome=rec.outcome, input_tokens=rec.input_tokens,
                  output_tokens=rec.output_tokens, cost=rec.cost_usd, latency_s=rec.latency_s, message=rec.message)

    def unusable(self, model: str, outcome: str, message: str) -> None:
        """A response the search could not use (its tokens and cost are on its call's own row)."""
        self._add(model=model, purpose="propose", outcome=outcome, message=message)

    def _add(self, **row: Any) -> None:
        row_id = self.db.add_llm_call(**row)
        rows = getattr(self._local, "rows", None)
        if rows is not None and row["purpose"] == "propose":
            rows.append(row_id)
