"""A program-process entry point that only resolves where /tmp is readable, i.e. without
Landlock (tests/test_runtime.py: the judge gives up the confinement a machine cannot start under)."""

from __future__ import annotations

import os
from pathlib import Path

# In /tmp itself, not the temp folder: a program process's TMPDIR is its own folder, which it may read.
MARKER = Path("/tmp") / f"commweave_landlocked_serve_{os.getuid()}"


def _serve(ctx, conn) -> None:
    conn.recv()


def __getattr__(name: str):
    if name == "serve":
        MARKER.read_text()  # PermissionError under Landlock: the temp folder is denied to programs
        return _serve
    raise AttributeError(name)
