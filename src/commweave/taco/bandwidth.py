"""Algorithm bandwidth of the device-initiated compressed collectives against NCCL BF16, side by
side on the same ranks: the measurement issue 5's table comes from (`bench/taco_bandwidth.py` runs
it on a worker pool and writes the results JSON; the GPU test runs it at two sizes).

Message = the full BF16 tensor (all-gather's output, reduce-scatter's input, all-reduce's tensor);
algorithm bandwidth = message bytes / median time, the time being the slowest rank's GPU time of
one call (`timing.gated_seconds`: held until queued, ranks lined up by a device barrier).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from commweave.runtime.timers import gated_seconds
from commweave.taco import collectives as cc
from commweave.taco.quant import QuantConfig

OPS = ("all_gather", "reduce_scatter", "all_reduce_one_shot", "all_reduce_two_shot")


def ranks_median_ms(ctx: Any, fn: Callable[[], Any], iters: int, warmup: int = 3) -> float:
    """Median over iterations of the slowest rank's GPU time of `fn()`, in ms."""
    for _ in range(warmup):
        fn()
    times = torch.tensor([gated_seconds(ctx, fn)[0] for _ in range(iters)], device=ctx.device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return float(times.median()) * 1e3


def _iters(mib: float) -> int:
    return 30 if mib <= 16 else 10


_VARIANT = re.compile(r"^(cuda|triton)(-fused)?$")


def variant(name: str) -> dict[str, Any]:
    """A measured variant's DeviceBackend arguments: "cuda", "triton", or "cuda-fused" (the reading
    kernels perform the read barrier: no barrier kernel)."""
    m = _VARIANT.match(name)
    if not m or (m.group(2) and m.group(1) != "cuda"):
        raise ValueError(f"a variant is cuda, triton or cuda-fused, not {name!r}")
    return {"codec": m.group(1), "fuse_barriers": bool(m.group(2))}


def measure(ctx: Any, mibs: Sequence[float] = (16, 256), codecs: Sequence[str] = ("cuda",),
            cfg_kwargs: dict | None = None, double_buffer: bool = True) -> list[dict]:
    """One row per (size, op): NCCL's time and each variant's (the device backend with that codec,
    see `variant`), their bandwidths and speedups. A pool job: every rank runs it; rank
    0's rows are the answer."""
    from commweave.taco.device import DeviceBackend

    world = ctx.world_size
    cfg = QuantConfig(**(cfg_kwargs or {}))
    backends = {name: DeviceBackend(ctx, double_buffer=double_buffer, **variant(name)) for name in codecs}
    rows = []
    for mib in mibs:
        n = int(mib * (1 << 20)) // 2 // (world * cfg.group_size) * (world * cfg.group_size)
        full = torch.randn(n, device=ctx.device, dtype=torch.bfloat16)
        shard = full[: n // world].clone()
        nbytes = n * 2
        calls: dict[str, tuple[Callable[[Any], Any], Callable[[], Any]]] = {
            "all_gather": (lambda b: b.all_gather(shard, cfg), lambda: cc.all_gather(shard)),
            "reduce_scatter": (lambda b: b.reduce_scatter(full, cfg), lambda: cc.reduce_scatter(full)),
            "all_reduce_one_shot": (lambda b: b.all_reduce(full, cfg, "one_shot"), lambda: cc.all_reduce(full)),
            "all_reduce_two_shot": (lambda b: b.all_reduce(full, cfg, "two_shot"), lambda: cc.all_reduce(full)),
        }
        for op in OPS:
            ours, nccl = calls[op]
            nccl_ms = ranks_median_ms(ctx, nccl, _iters(mib))
            row: dict[str, Any] = {"op": op, "mib": mib, "world": world, "nccl_ms": nccl_ms,
                                   "nccl_GBps": nbytes / nccl_ms / 1e6}
            for name, backend in backends.items():
                ms = ranks_median_ms(ctx, lambda: ours(backend), _iters(mib))
                row.update({f"{name}_ms": ms, f"{name}_GBps": nbytes / ms / 1e6, f"{name}_speedup": nccl_ms / ms})
            rows.append(row)
        del full, shard
    for backend in backends.values():
        backend.close()
    ctx.end_candidate()
    return rows
