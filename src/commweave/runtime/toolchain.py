"""Where the CUDA compiler and the NCCL library/headers are.

The NCCL that matters is the one torch loaded: device communicators and windows are created by
that library, so headers and the host shim must match its version exactly.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


class ToolchainError(RuntimeError):
    """A compiler or library the runtime needs is missing."""


@dataclass(frozen=True)
class NcclInstall:
    """One NCCL installation: its shared library and the headers that describe it."""

    library: Path
    include_dir: Path
    header_version: int  # NCCL_VERSION_CODE from nccl.h, e.g. 22809

    @property
    def lib_dir(self) -> Path:
        return self.library.parent


def nccl_version_string(code: int) -> str:
    """22809 -> '2.28.9' (NCCL's code is major*10000 + minor*100 + patch)."""
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


@functools.lru_cache(maxsize=1)
def nvcc_path() -> Path:
    for candidate in (os.environ.get("COMMWEAVE_NVCC"), shutil.which("nvcc")):
        if candidate and Path(candidate).exists():
            return Path(candidate)
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    guess = Path(cuda_home) / "bin" / "nvcc"
    if guess.exists():
        return guess
    raise ToolchainError("nvcc not found: put it on PATH or set COMMWEAVE_NVCC / CUDA_HOME")


@functools.lru_cache(maxsize=1)
def nvcc_version() -> str:
    out = subprocess.run([str(nvcc_path()), "--version"], capture_output=True, text=True, check=True)
    match = re.search(r"release ([\d.]+), V([\d.]+)", out.stdout)
    return match.group(2) if match else out.stdout.strip().splitlines()[-1]


def _loaded_nccl_library() -> Path | None:
    """The libnccl already mapped into this process (torch's), if any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if "/libnccl.so" in path and Path(path).exists():
            return Path(path)
    return None


def _wheel_nccl_root() -> Path | None:
    spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _header_version(include_dir: Path) -> int:
    text = (include_dir / "nccl.h").read_text()
    match = re.search(r"#define\s+NCCL_VERSION_CODE\s+(\d+)", text)
    if not match:
        raise ToolchainError(f"{include_dir / 'nccl.h'} has no NCCL_VERSION_CODE")
    return int(match.group(1))


def _include_dir_for(library: Path) -> Path | None:
    for cand in (library.parent.parent / "include", library.parent.parent.parent / "include"):
        if (cand / "nccl.h").exists() and (cand / "nccl_device.h").exists():
            return cand
    return None


@functools.lru_cache(maxsize=1)
def find_nccl() -> NcclInstall:
    """The NCCL to bind: torch's loaded libnccl if there is one, else the pip wheel's.

    `COMMWEAVE_NCCL_HOME` (a folder with lib/ and include/) overrides both.
    """
    home = os.environ.get("COMMWEAVE_NCCL_HOME")
    if home:
        lib = Path(home) / "lib" / "libnccl.so.2"
        inc = Path(home) / "include"
        if not lib.exists() or not (inc / "nccl_device.h").exists():
            raise ToolchainError(f"COMMWEAVE_NCCL_HOME={home} lacks lib/libnccl.so.2 or include/nccl_device.h")
        return NcclInstall(lib, inc, _header_version(inc))
    loaded = _loaded_nccl_library()
    wheel = _wheel_nccl_root()
    if loaded is not None:
        inc = _include_dir_for(loaded)
        if inc is None and wheel is not None and (wheel / "include" / "nccl_device.h").exists():
            inc = wheel / "include"
        if inc is None:
            raise ToolchainError(f"torch loaded {loaded} but no nccl_device.h was found beside it")
        return NcclInstall(loaded, inc, _header_version(inc))
    if wheel is not None and (wheel / "lib" / "libnccl.so.2").exists():
        return NcclInstall(wheel / "lib" / "libnccl.so.2", wheel / "include", _header_version(wheel / "include"))
    raise ToolchainError("no NCCL found: `pip install nvidia-nccl-cu13==2.28.9` or set COMMWEAVE_NCCL_HOME")


def cache_dir() -> Path:
    """Where compiled artefacts live (COMMWEAVE_CACHE, else ~/.cache/commweave)."""
    root = Path(os.environ.get("COMMWEAVE_CACHE") or Path.home() / ".cache" / "commweave")
    root.mkdir(parents=True, exist_ok=True)
    return root


def shared_cache_dirs() -> list[Path]:
    """Read-only caches searched before `cache_dir()` (COMMWEAVE_CACHE_SHARED, os.pathsep-separated):
    a confined program process reads the judge's artefacts there and writes what it compiles
    itself to its private cache, so no candidate can plant an artefact another program loads."""
    return [Path(p) for p in os.environ.get("COMMWEAVE_CACHE_SHARED", "").split(os.pathsep) if p]
