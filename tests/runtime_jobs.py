"""Job functions for the CPU pool tests (workers import them by name)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist


def rank_sum(ctx, offset: int) -> float:
    t = torch.tensor([float(offset + ctx.rank)])
    dist.all_reduce(t)
    return float(t)


def hang_on_rank0(ctx) -> str:
    if ctx.rank == 0:
        time.sleep(3600)
    return "done"


def raise_on_rank1(ctx) -> None:
    if ctx.rank == 1:
        raise ValueError("rank 1 broke")


def exit_on_rank0(ctx) -> None:
    if ctx.rank == 0:
        os._exit(9)
    time.sleep(3600)


def torch_mm_is_pristine(ctx) -> bool:
    """Whether this judge's torch.mm is still torch's own (no program code ran here)."""
    return torch.mm is torch._C._VariableFunctions.mm


def allocate_and_drop(ctx, nbytes: int) -> int:
    """GPUs: allocate `nbytes` on the device, use them, drop them; what torch's allocator reserves."""
    block = torch.ones(nbytes, dtype=torch.uint8, device=ctx.device)
    del block
    return torch.cuda.memory_reserved(ctx.device)


def reserved_bytes(ctx) -> int:
    """GPUs: what torch's caching allocator of this judge reserves right now."""
    return torch.cuda.memory_reserved(ctx.device)


def leave_a_cycle(ctx, nbytes: int) -> int:
    """GPUs: `nbytes` on the device held only by a reference cycle when the job returns (as a job's
    objects that point at each other hold its buffers); what torch's allocator reserves then."""
    cycle: dict = {"block": torch.ones(nbytes, dtype=torch.uint8, device=ctx.device)}
    cycle["self"] = cycle
    return torch.cuda.memory_reserved(ctx.device)


def drop_confinement(ctx) -> str:
    """This judge's later program processes start with no optional confinement (no namespaces,
    Landlock or dropped privileges): bench/judge_throughput.py --unconfined times what those cost."""
    from commweave.runtime import candidate

    candidate._CONFINEMENT = candidate.Confinement(network=False, filesystem=False, dropped="all, for a measurement")
    return repr(candidate._CONFINEMENT)
