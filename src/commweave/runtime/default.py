"""The process-default rank context: one `RankContext` over the default process group per process.

`commweave.ops` and TACO's device collectives share it, so a user's program holds one set of
windows and one device communicator, made at the first call that needs them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commweave.runtime.context import RankContext

_context: RankContext | None = None


def context(device: torch.device | str | None = None) -> RankContext:
    """This process's RankContext over the default process group, created at first use (a
    collective: every rank's first call makes it together) and kept until `close_context()`."""
    global _context
    wanted = _normalized(device) if device is not None else None
    if _context is None:
        _context = RankContext.from_process_group(wanted)
    elif wanted is not None and wanted != _context.device:
        raise ValueError(f"commweave runs on one device per process: its context is on {_context.device}, "
                         f"these tensors are on {wanted}")
    return _context


def current_context() -> RankContext | None:
    """The context if one was made, else None (never creates one)."""
    return _context


def close_context() -> None:
    """Collective: close the context (NCCL communicator, windows) and its gloo group."""
    global _context
    if _context is None:
        return
    ctx, _context = _context, None
    ctx.close()
    if dist.is_initialized():
        dist.destroy_process_group(ctx.cpu_group)


def _normalized(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
