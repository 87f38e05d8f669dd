"""Test helpers: check a program's CUDA on this CPU-only machine.

Copy loops written `__host__ __device__` can be compiled together with a host `main` that drives
them over many cases and run here; without nvcc or NCCL's headers the test is skipped, saying why."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from commweave.runtime.toolchain import ToolchainError, find_nccl, nvcc_path


def toolchain_or_skip() -> None:
    try:
        nvcc_path()
        find_nccl()
    except ToolchainError as exc:
        pytest.skip(f"cannot compile CUDA here: {exc}")


def nvcc_host_build(source: str, workdir: Path, name: str, *flags: str) -> subprocess.CompletedProcess:
    """nvcc `source` (sm_90, NCCL's headers) into workdir/name with `flags`; the completed process."""
    toolchain_or_skip()
    path = workdir / f"{name}.cu"
    path.write_text(source)
    return subprocess.run([str(nvcc_path()), "-std=c++17", "-arch=sm_90", f"-I{find_nccl().include_dir}", *flags,
                           str(path), "-o", str(workdir / name)], capture_output=True, text=True)


def run_host_check(cuda_source: str, main: str, workdir: Path, name: str, timeout_s: float = 120) -> str:
    """Build `cuda_source + main` for the host and run it; it must print ' wrong 0' and exit 0."""
    build = nvcc_host_build(cuda_source + main, workdir, name, "-O2")
    assert build.returncode == 0, build.stdout + build.stderr
    result = subprocess.run([str(workdir / name)], capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0 and " wrong 0" in result.stdout, result.stdout + result.stderr
    return result.stdout
