"""The process-default rank contexts: one `RankContext` per process group this process uses.

`commweave.ops` and TACO's device collectives share them, so a user's program holds one set of
windows and one device communicator per group (TP pairs and a DP group side by side each get
their own, over exactly their ranks), made at the first call that needs them and kept until
`close_context()`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from commweave.runtime.context import RankContext

#: set to 1 to give every group a communicator of commweave's own instead of torch's (where torch
#: exposes its `ncclComm_t`, the contexts use torch's by default: no second communicator)
OWN_COMM_ENV = "COMMWEAVE_OWN_NCCL_COMM"

_contexts: dict[str, RankContext] = {}  # group name -> context


def _group_name(group: Any) -> str:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group() "
                           "first (one process per GPU; NCCL on CUDA, gloo on CPU)")
    return (dist.group.WORLD if group is None else group).group_name


def context(device: torch.device | str | None = None, group: Any = None) -> RankContext:
    """This process's RankContext over `group` (None: the default group), created at first use (a
    collective over the group's members: every member's first call makes it together) and kept
    until `close_context()`. All contexts of a process live on one device."""
    name = _group_name(group)
    wanted = _normalized(device) if device is not None else None
    held = next(iter(_contexts.values()), None)
    if wanted is None and held is not None:
        wanted = held.device
    if held is not None and wanted != held.device:
        raise ValueError(f"commweave runs on one device per process: its contexts are on {held.device}, "
                         f"these tensors are on {wanted}")
    if name not in _contexts:
        _contexts[name] = RankContext.from_process_group(wanted, group,
                                                         torch_comm=os.environ.get(OWN_COMM_ENV, "0") != "1")
    return _contexts[name]


def current_context(group: Any = None) -> RankContext | None:
    """The context of `group` (None: the default group) if one was made, else None (never creates
    one)."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    return _contexts.get((dist.group.WORLD if group is None else group).group_name)


def contexts() -> dict[str, RankContext]:
    """Every context made so far, by group name (a copy)."""
    return dict(_contexts)


def close_context(group: Any = None) -> None:
    """Collective over each group's members: close the contexts (NCCL communicators, windows) and
    their gloo groups; `group` None closes every context of this process, newest first."""
    if group is None:
        names = list(reversed(_contexts))
    else:
        names = [_group_name(group)] if _group_name(group) in _contexts else []
    for name in names:
        ctx = _contexts.pop(name)
        ctx.close()
        if dist.is_initialized() and ctx.cpu_group is not ctx.group:  # a gloo group of the context's own
            dist.destroy_process_group(ctx.cpu_group)


def _normalized(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
