"""The environment a test hands its worker pool, so that judges and program processes import
this folder's helpers (toy workloads, job modules) and the source tree as the test itself does."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def worker_env() -> dict[str, str]:
    """PYTHONPATH: tests/, src/, then whatever the caller's PYTHONPATH already held."""
    paths = [str(TESTS), str(TESTS.parent / "src"), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
