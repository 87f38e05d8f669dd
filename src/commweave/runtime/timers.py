"""GPU timers: one multi-rank timed region (`gated_seconds`), one call on one GPU (`cuda_call_us`)
and their median (`cuda_median_us`).

Each queues the timed work behind a hold (a gate or a spin kernel) so the events see the GPU's
time, not the host's launch latency.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any


def gated_seconds(ctx: Any, fn: Callable[[], object], after: Callable[[], Any] | None = None) -> tuple[float, Any]:
    """One multi-rank timed region on GPUs: the stream is held until `fn()` is queued
    (`ctx.hold_stream`), the ranks are lined up by a device barrier, then `fn()` runs between two
    events, so the time is the GPUs' own, not the hosts' launch time or their skew. `after()` is
    queued right after the end event (what the timer saw); returns (seconds, its result)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    release = ctx.hold_stream()
    ctx.device_barrier()
    start.record()
    fn()
    end.record()
    release()
    seen = after() if after is not None else None
    torch.cuda.synchronize(ctx.device)
    return start.elapsed_time(end) * 1e-3, seen


HOLD_CYCLES = 2_000_000  # ~1 ms of GPU clock: longer than the host takes to queue a probe's launches


def cuda_call_us(fn: Callable[[], object]) -> float:
    """GPU time of one `fn()` on the current stream in µs (CUDA events), queued behind a ~1 ms spin
    kernel, so its launches are all queued before the start event fires: the time is the GPU's, not
    the host's launch latency (without the hold, a 50 µs kernel launched from Python measured ~90 µs)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(HOLD_CYCLES)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def cuda_median_us(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median of `cuda_call_us(fn)` over `iters` calls after `warmup` untimed ones: the one-GPU
    timer of probes and kernel tests (multi-rank calls: `gated_seconds`)."""
    for _ in range(warmup):
        fn()
    return statistics.median(cuda_call_us(fn) for _ in range(iters))
