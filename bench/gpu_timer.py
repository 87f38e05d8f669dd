"""The one-GPU timer the probes share: CUDA events around a callable, median of repeated calls."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def median_us(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median GPU time of `fn()` in µs over `iters` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)
