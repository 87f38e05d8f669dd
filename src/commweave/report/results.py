"""Results files: every measured figure is written with the device, versions, commit, date and
the command that produced it (`runtime.provenance`), so a number in the README can be traced to a run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from commweave.runtime.provenance import Provenance

RESULTS_DIR = Path("bench/results")


def write_results(name: str, payload: dict[str, Any], command: list[str] | None = None,
                  out_dir: Path = RESULTS_DIR, provenance: Provenance | None = None) -> Path:
    """Write `payload` with provenance (`provenance`, else this process now with `command`) to
    `out_dir/<name>-<UTC timestamp of the provenance>.json`."""
    origin = provenance or Provenance.now(command)
    record = {"name": name, **origin.to_json(), **payload}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}-{origin.date.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return path
