"""The slow-path prompts: what a model is told about the task, the design space, the machine, the
parent and its neighbours, and how it must answer.

Each section is a function of data the search holds (the workload, the space, measured rates and
facts, database records), so a prompt says nothing the run did not measure or declare. Sections
are markdown headed by `## <title>`; `SECTIONS` lists the titles a proposal prompt holds.
"""

from __future__ import annotations

import difflib
import json
from collections import Counter
from typing import Any, Iterable, Mapping

from commweave.evaluate.floor import MachineRates
from commweave.llm.patch import DIFF_FORMAT
from commweave.search.db import ProgramRecord
from commweave.space import DIMENSIONS, DirectiveSet, Space, program_body
from commweave.space.directives import DESCRIPTIONS, fmt_bytes
from commweave.contracts.workload import Cost

SYSTEM = (
    "You improve multi-GPU programs that overlap computation with device-initiated communication "
    "(NCCL's device API: loads/stores into peers' symmetric windows over NVLink, GPU-initiated networking, "
    "copy engines driven by stream-written flags). Each program is a Python module whose editable code lies "
    "between EVOLVE-BLOCK-START and EVOLVE-BLOCK-END markers. It is compiled, checked for correctness on fresh "
    "inputs on every rank, and timed side by side with the baseline. You answer in the exact format asked for."
)

SECTIONS = ("Task", "Design space", "Hardware", "Parent program", "Inspirations", "Recent failures",
            "What worked so far", "Your answer")

MAX_DIFF_LINES = 60  # lines of an inspiration's diff against the parent shown in a prompt
MAX_MESSAGE_CHARS = 600  # of one failure message


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _clip(text: str, limit: int) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + f" … [{len(text) - limit} more characters]"


def task(workload: str, summary: str, shape: Any, world_size: int, baseline: str) -> str:
    return (f"## Task\n"
            f"- workload: `{workload}` — {summary}\n"
            f"- shape: `{shape}`\n"
            f"- GPUs (ranks): {world_size}\n"
            f"- fitness = (median time of the baseline `{baseline}`) / (median time of the program), both measured in the "
            f"same run on the same GPUs; higher is better. A program that fails to compile, gives a wrong result, "
            f"hangs, crashes or times faster than the physical floor (below) scores 0.\n")


def design_space(space: Space, knobs: Mapping[str, Iterable[Any]]) -> str:
    lines = ["## Design space",
             "A directive set names the strategy a program implements. Dimensions and their values:"]
    for dim in DIMENSIONS:
        values = space.values(dim)
        described = DESCRIPTIONS.get(dim)
        if described:
            lines.append(f"- {dim}:")
            lines += [f"  - `{v}`: {described[v]}" for v in values]
        elif dim == "chunk_bytes":
            lines.append(f"- chunk_bytes: bytes per transfer, a power of two from {fmt_bytes(values[0])} to "
                         f"{fmt_bytes(values[-1])}: {', '.join(map(str, values))}")
        elif dim == "comm_ctas":
            lines.append(f"- comm_ctas: CTAs (SMs) given to communication: {', '.join(map(str, values))} "
                         "(0 only with backend ce)")
        else:
            lines.append(f"- {dim}: {', '.join(map(str, values))}")
    lines.append(f"- compression admitted by this workload's tolerance ({space.tolerance}): "
                 f"{', '.join(space.admitted_compressions())}")
    caps = space.capabilities
    lines.append(f"- backend gin on this machine: {'available' if caps.gin else 'not available: ' + caps.gin_reason}")
    if knobs:
        lines.append("- knobs (the program's own CONFIG entries, free to change or extend with your code): "
                     + "; ".join(f"`{k}` in {', '.join(map(repr, v))}" for k, v in knobs.items()))
    return "\n".join(lines) + "\n"


def hardware(rates: MachineRates, measured: bool, cost: Cost, floor_s: float, facts: Mapping[str, Any]) -> str:
    source = "measured on this machine's GPUs" if measured else "reference values (H200), not measured in this run"
    lines = ["## Hardware",
             f"Rates ({source}):",
             f"- matmul: {rates.matmul_flops_per_s / 1e12:.1f} TFLOP/s",
             f"- peer link (NVLink copy, one direction): {rates.link_bytes_per_s / 1e9:.1f} GB/s",
             f"- HBM copy (reads + writes): {rates.hbm_bytes_per_s / 1e12:.2f} TB/s",
             "Work of one call per rank at this shape:",
             f"- {cost.flops / 1e9:.3f} GFLOP, {cost.comm_bytes / 2**20:.2f} MiB received from peers, "
             f"{cost.memory_bytes / 2**20:.2f} MiB through HBM",
             f"- physical floor (busiest resource at the rates above, perfect overlap): {floor_s * 1e6:.1f} µs"]
    if facts:
        lines.append("Machine facts:")
        lines += [f"- {k}: {v}" for k, v in facts.items()]
    return "\n".join(lines) + "\n"


def measured(record: ProgramRecord) -> str:
    t = record.timings
    parts = [f"fitness {record.fitness:.4g}"]
    if t.get("candidate_us") is not None:
        parts.append(f"median {t['candidate_us']:.1f} µs")
    for name, us in (t.get("baselines_us") or {}).items():
        if us is not None:
            parts.append(f"baseline {name} {us:.1f} µs")
    if t.get("floor_us") is not None:
        parts.append(f"floor {t['floor_us']:.1f} µs")
    return ", ".join(parts)


def program(title: str, record: ProgramRecord) -> str:
    ds = DirectiveSet.from_dict(record.directives) if record.directives else None
    return (f"## {title}\n"
            f"Program #{record.id} ({measured(record)}).\n"
            f"Its directive set (JSON): `{_json(record.directives)}`\n\n"
            + (ds.render_prompt().replace("## Directives", "### Directives") + "\n" if ds else "")
            + f"```python\n{program_body(record.code)}```\n")


def _diff(parent: ProgramRecord, other: ProgramRecord) -> str:
    lines = list(difflib.unified_diff(program_body(parent.code).splitlines(), program_body(other.code).splitlines(),
                                      f"#{parent.id}", f"#{other.id}", lineterm="", n=2))
    if len(lines) > MAX_DIFF_LINES:
        lines = lines[:MAX_DIFF_LINES] + [f"... [{len(lines) - MAX_DIFF_LINES} more diff lines]"]
    return "\n".join(lines) or "(same code as the parent)"


def inspirations(parent: ProgramRecord, records: Iterable[ProgramRecord]) -> str:
    records = list(records)
    if not records:
        return "## Inspirations\nNone yet.\n"
    out = ["## Inspirations", "Good programs of this run, each as a diff against the parent:"]
    for r in records:
        out += [f"### Program #{r.id} ({measured(r)}; island {r.island}; {r.timings.get('how', r.proposer)})",
                f"directives: `{_json(r.directives)}`", "```diff", _diff(parent, r), "```"]
    return "\n".join(out) + "\n"


def failures(records: Iterable[ProgramRecord]) -> str:
    records = list(records)
    if not records:
        return "## Recent failures\nNone yet.\n"
    out = ["## Recent failures", "The latest programs that failed, with the checker's message:"]
    for r in records:
        out.append(f"- #{r.id} ({r.timings.get('how', r.proposer)}; directives `{_json(r.directives)}`): "
                   f"{r.failure}: {_clip(r.message, MAX_MESSAGE_CHARS)}")
    return "\n".join(out) + "\n"


def meta_summary(text: str) -> str:
    return "## What worked so far\n" + (text.strip() or "No summary yet.") + "\n"


ANSWER_FORMAT = ("First, a ```json block holding the complete directive set your program implements: an object with "
                 "the keys of the parent's directive JSON (backend, placement, sync, issuer, comm_ctas, chunk_bytes, "
                 "compression, group_size, language, knobs); every value must be valid in the design space above.")


def answer(patch: str, partner: ProgramRecord | None = None) -> str:
    lines = ["## Your answer", ANSWER_FORMAT]
    if patch == "diff":
        lines.append("Then one or more SEARCH/REPLACE edits of the parent program, each in this form:\n"
                     f"{DIFF_FORMAT}\nEach SEARCH must copy whole lines of the parent exactly (whitespace included) and "
                     "match exactly once, between the EVOLVE-BLOCK markers. Change only what your strategy needs.")
    elif patch == "full":
        lines.append("Then the whole new program in one ```python block: rewrite the code between the EVOLVE-BLOCK "
                     "markers as your strategy needs; everything outside them, marker lines included, exactly as in "
                     "the parent.")
    elif patch == "crossover":
        lines.append(f"Combine the parent with program #{partner.id} (below): take what makes each fast and write the "
                     "whole new program in one ```python block; everything outside the EVOLVE-BLOCK markers, marker "
                     "lines included, exactly as in the parent.")
    else:
        raise ValueError(f"unknown patch type {patch!r}")
    lines.append("Keep `setup(ctx, shape)` and `run(ctx, state, inputs, out)`; the result must be correct on every rank.")
    return "\n".join(lines) + "\n"


def resample(kind: str, message: str) -> str:
    """The message that sends a model's unusable answer back with the reason."""
    return (f"Your answer could not be used ({kind}): {message}\n\n"
            f"Answer again, in the required format. {ANSWER_FORMAT}")


def meta_request(best: list[ProgramRecord], failed: list[ProgramRecord], previous: str) -> str:
    """The meta call's prompt: what the database holds, for a summary later prompts carry."""
    lines = ["## Run so far", "The best programs (fitness, how they were made, directives):"]
    lines += [f"- #{r.id}: fitness {r.fitness:.4g}; {r.timings.get('how', r.proposer)}; `{_json(r.directives)}`"
              for r in best] or ["- none correct yet"]
    classes = Counter(r.failure for r in failed)
    lines.append("Failures by class, with the latest message of each:")
    latest = {r.failure: r for r in failed}
    lines += [f"- {cls}: {n} (e.g. #{latest[cls].id} `{_json(latest[cls].directives)}`: "
              f"{_clip(latest[cls].message, 300)})" for cls, n in classes.most_common()] or ["- none"]
    if previous.strip():
        lines += ["", "Your previous summary:", previous.strip()]
    lines += ["", "Summarise in at most 10 short bullet points what made programs faster, what made them fail, and "
                  "what is still untried, concretely (directive values, code changes), for the engineer who writes the "
                  "next programs. Only the bullet points."]
    return "\n".join(lines) + "\n"
