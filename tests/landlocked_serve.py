"""A program-process entry point that only resolves where the temp folder is readable, i.e. without
Landlock (tests/test_runtime.py: the judge gives up the confinement a machine cannot start under)."""

from __future__ import annotations

import tempfile
from pathlib import Path

MARKER = Path(tempfile.gettempdir()) / "commweave_landlocked_serve"


def _serve(ctx, conn) -> None:
    conn.recv()


def __getattr__(name: str):
    if name == "serve":
        MARKER.read_text()  # PermissionError under Landlock: the temp folder is denied to programs
        return _serve
    raise AttributeError(name)
