"""What this machine offers, read without starting a CUDA context: GPUs, links, NCCL, nvcc, NICs.

Per-rank facts that need a communicator (LSA team size, whether GIN works) come from the
`selftest.probe` job in the workers.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from commweave.runtime.toolchain import ToolchainError, find_nccl, nccl_version_string, nvcc_path, nvcc_version


def rdma_devices() -> list[str]:
    """RDMA-capable NICs the kernel knows (GIN needs one)."""
    root = Path("/sys/class/infiniband")
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nvlink_topology() -> str:
    """`nvidia-smi topo -m` as printed, or '' where nvidia-smi is absent."""
    if shutil.which("nvidia-smi") is None:
        return ""
    proc = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
    return proc.stdout.strip()


def host_capabilities() -> dict[str, Any]:
    import torch

    caps: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "gpus": cuda_device_count()}
    try:
        caps["nvcc"] = f"{nvcc_path()} ({nvcc_version()})"
    except (ToolchainError, OSError, subprocess.SubprocessError) as exc:
        caps["nvcc"] = f"missing: {exc}"
    try:
        nccl = find_nccl()
        caps["nccl_headers"] = f"{nccl.include_dir} ({nccl_version_string(nccl.header_version)})"
        caps["nccl_library"] = str(nccl.library)
    except ToolchainError as exc:
        caps["nccl_headers"] = caps["nccl_library"] = f"missing: {exc}"
    caps["rdma_nics"] = rdma_devices()
    caps["topology"] = nvlink_topology()
    return caps
