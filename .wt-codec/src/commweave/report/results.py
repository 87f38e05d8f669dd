"""Results files: every measured figure is written with the device, versions, commit, date and
the command that produced it, so a number in the README can be traced to a run."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS_DIR = Path("bench/results")


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


def write_results(name: str, payload: dict[str, Any], command: list[str] | None = None,
                  out_dir: Path = RESULTS_DIR) -> Path:
    """Write `payload` with provenance to `out_dir/<name>-<UTC timestamp>.json`."""
    now = dt.datetime.now(dt.timezone.utc)
    record = {
        "name": name,
        "date": now.isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": " ".join(command if command is not None else ["commweave", *sys.argv[1:]]),
        "environment": environment(),
        **payload,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return path
