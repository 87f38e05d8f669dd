"""Workloads: each a folder with its shapes, reference, baselines and device-initiated programs."""

from __future__ import annotations

from commweave.workloads.base import Cost, Shape, Workload


def registry() -> dict[str, Workload]:
    """Every workload by its command-line name."""
    from commweave.workloads.attention_cp.workload import AttentionCP
    from commweave.workloads.gemm_allgather.workload import GemmAllGather, GemmAllGatherLossy
    from commweave.workloads.kv_transfer.workload import KvTransfer
    from commweave.workloads.moe.workload import MoELayer, MoELayerLossy

    workloads: list[Workload] = [GemmAllGather(), GemmAllGatherLossy(), AttentionCP(), MoELayer(), MoELayerLossy(),
                                  KvTransfer()]
    return {w.name: w for w in workloads}


def get_workload(name: str) -> Workload:
    known = registry()
    if name not in known:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(sorted(known))}")
    return known[name]


__all__ = ["Cost", "Shape", "Workload", "get_workload", "registry"]
