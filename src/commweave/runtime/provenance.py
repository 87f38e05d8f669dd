"""Provenance of a measurement: the device, versions, commit, date and command that produced it,
so every measured figure can be traced to a run (results files and bench reports carry it)."""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def git_commit() -> str:
    """HEAD's hash, with '+dirty' when the working tree differs from it.

    COMMWEAVE_COMMIT overrides it, for copies of the tree without git history (the GPU machine)."""
    if os.environ.get("COMMWEAVE_COMMIT"):
        return os.environ["COMMWEAVE_COMMIT"]
    sha = _run(["git", "rev-parse", "--verify", "-q", "HEAD"])
    if not re.fullmatch(r"[0-9a-f]{40}", sha):
        return "unknown"
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return f"{sha}+dirty" if dirty else sha


def gpu_names() -> list[str]:
    """GPU names from nvidia-smi (no CUDA context is created in this process)."""
    if shutil.which("nvidia-smi") is None:
        return []
    out = _run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    return [line.strip() for line in out.splitlines() if line.strip()]


def environment() -> dict[str, Any]:
    """GPUs, torch / CUDA / NCCL / Triton / Python versions and the host name."""
    import torch

    env: dict[str, Any] = {
        "gpus": gpu_names(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
    }
    try:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except (RuntimeError, AttributeError):
        env["nccl"] = None
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


@dataclass(frozen=True)
class Provenance:
    """Where and from what a measurement came; `to_json()` gives the results files' top-level keys."""

    date: dt.datetime
    commit: str
    command: str
    environment: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def now(cls, command: Sequence[str] | None = None) -> Provenance:
        """This process, now; `command` defaults to `commweave` and this process's arguments."""
        args = command if command is not None else ["commweave", *sys.argv[1:]]
        return cls(dt.datetime.now(dt.timezone.utc), git_commit(), " ".join(args), environment())

    def to_json(self) -> dict[str, Any]:
        return {"date": self.date.isoformat(timespec="seconds"), "commit": self.commit, "command": self.command,
                "environment": self.environment}
