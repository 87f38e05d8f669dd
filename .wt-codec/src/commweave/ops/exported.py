"""The exported program file: a candidate program text with one more comment line that says which
workload it is for, so `commweave.ops.load(path)` needs nothing else.

    # commweave-directives: {...}                             (first line, as the search wrote it)
    # commweave-export: {"workload": "gemm-allgather", "program_id": 17, ...}
    ...the program...

The export line is a comment, so the file is still an ordinary program for the evaluator and
`commweave bench --candidate`.
"""

from __future__ import annotations

import json
from typing import Any

from commweave.space.template import DIRECTIVES_PREFIX

EXPORT_PREFIX = "# commweave-export: "


def export_text(code: str, workload: str, **provenance: Any) -> str:
    """`code` with its export line (after the directive line, which stays first); an export line
    already in `code` is replaced. `provenance` (run, program id, fitness, shape, ...) goes into
    the same JSON object, for people reading the file."""
    if not workload:
        raise ValueError("an exported program must name its workload")
    line = EXPORT_PREFIX + json.dumps({"workload": workload, **provenance}, sort_keys=True, default=str) + "\n"
    lines = [ln for ln in code.splitlines(keepends=True) if not ln.startswith(EXPORT_PREFIX)]
    at = 1 if lines and lines[0].startswith(DIRECTIVES_PREFIX) else 0
    return "".join(lines[:at] + [line] + lines[at:])


def export_info(text: str) -> dict[str, Any] | None:
    """The export line's object (it has at least "workload"), or None for a file without one."""
    for line in text.splitlines():
        if line.startswith(EXPORT_PREFIX):
            try:
                info = json.loads(line[len(EXPORT_PREFIX):])
            except json.JSONDecodeError as exc:
                raise ValueError(f"malformed {EXPORT_PREFIX.strip()} line: {exc}") from exc
            if not isinstance(info, dict) or not isinstance(info.get("workload"), str):
                raise ValueError(f"the {EXPORT_PREFIX.strip()} line must be a JSON object with a \"workload\" name")
            return info
    return None
