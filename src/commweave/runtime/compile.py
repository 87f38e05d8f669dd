"""Compile service: CUDA source -> cubin (kernels) or shared library (host shims), cached on disk.

The cache key is the source, the flags, nvcc's version and the NCCL headers' version, so a cached
artefact is never reused across toolchains. The compiler's output is kept verbatim: it is what a
search or an LLM needs to repair a failing candidate.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from commweave.runtime.toolchain import cache_dir, find_nccl, nvcc_path, nvcc_version, shared_cache_dirs

ARCH_FLAGS = ("-arch=sm_90",)
BASE_FLAGS = ("-std=c++17", "-O3", "-lineinfo")


class CompileError(RuntimeError):
    """nvcc rejected the source; `log` is its output, verbatim."""

    def __init__(self, message: str, log: str):
        super().__init__(message)
        self.log = log


@dataclass(frozen=True)
class CompiledArtifact:
    path: Path
    log: str  # nvcc's stdout+stderr (warnings, -Xptxas -v resource reports)
    cached: bool


def _key(source: str, kind: str, flags: tuple[str, ...]) -> str:
    nccl = find_nccl()
    h = hashlib.sha256()
    for part in (kind, nvcc_version(), str(nccl.header_version), " ".join(flags), source):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def _run_nvcc(source: str, kind: str, flags: tuple[str, ...], out_suffix: str, extra_tail: tuple[str, ...]) -> CompiledArtifact:
    key = _key(source, kind, flags + extra_tail)
    for shared in shared_cache_dirs():
        hit = shared / kind / f"{key}{out_suffix}"
        if hit.exists():
            log_path = hit.with_suffix(".log")
            return CompiledArtifact(hit, log_path.read_text() if log_path.exists() else "", cached=True)
    folder = cache_dir() / kind
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{key}{out_suffix}"
    log_path = folder / f"{key}.log"
    if out.exists():
        return CompiledArtifact(out, log_path.read_text() if log_path.exists() else "", cached=True)
    with tempfile.TemporaryDirectory(prefix="cw_nvcc_") as tmp:
        src = Path(tmp) / "source.cu"
        src.write_text(source)
        tmp_out = Path(tmp) / f"out{out_suffix}"
        cmd = [str(nvcc_path()), *flags, str(src), "-o", str(tmp_out), *extra_tail]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        log = (proc.stdout + proc.stderr).replace(str(src), "candidate.cu")
        if proc.returncode != 0:
            raise CompileError(f"nvcc failed (exit {proc.returncode})", log)
        # Atomic publish: concurrent compiles of the same key (processes or threads) never expose a
        # half-written file.
        staged = folder / f".{key}.{os.getpid()}.{threading.get_ident()}{out_suffix}"
        staged.write_bytes(tmp_out.read_bytes())
        log_path.write_text(log)
        staged.replace(out)
    return CompiledArtifact(out, log, cached=False)


def compile_cubin(source: str, extra_flags: tuple[str, ...] = ()) -> CompiledArtifact:
    """Device code -> cubin for sm_90, NCCL's device headers on the include path."""
    flags = ("-cubin", *ARCH_FLAGS, *BASE_FLAGS, "-Xptxas", "-v", f"-I{find_nccl().include_dir}", *extra_flags)
    return _run_nvcc(source, "cubin", flags, ".cubin", ())


def compile_host_library(source: str) -> CompiledArtifact:
    """Host-only code -> shared library linked against the NCCL that will be loaded."""
    nccl = find_nccl()
    # cudart is linked statically: the headers register an (unused) fatbinary at load time.
    flags = ("-shared", "-Xcompiler", "-fPIC", "-std=c++17", f"-I{nccl.include_dir}")
    tail = (f"-L{nccl.lib_dir}", f"-l:{nccl.library.name}", "-Xlinker", f"-rpath,{nccl.lib_dir}")
    return _run_nvcc(source, "hostlib", flags, ".so", tail)


def artifact_files(sources: dict[str, str]) -> dict[str, bytes]:
    """The cached cubins of `sources` (compiled here, or already), as cache-relative paths to
    bytes: what travels with a job to another node, whose own cache may not have them."""
    files: dict[str, bytes] = {}
    for source in sources.values():
        artifact = compile_cubin(source)
        files[str(artifact.path.relative_to(cache_dir()))] = artifact.path.read_bytes()
    return files


def install_artifacts(files: dict[str, bytes]) -> None:
    """Put shipped artefacts into this node's cache (atomically; an existing file is kept)."""
    root = cache_dir().resolve()
    for relative, data in files.items():
        target = (root / relative).resolve()
        if root not in target.parents:
            raise ValueError(f"artefact path {relative!r} leaves the compile cache")
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}")
        staged.write_bytes(data)
        staged.replace(target)
