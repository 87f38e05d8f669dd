"""The rank context a program and the harness's jobs get: what `ctx` offers, as a protocol.

`runtime.context.RankContext` implements it (and the one-GPU rank simulation in the tests fakes
it); programs, workloads and jobs are typed against this, so none of them imports the runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch


class ProgramContext(Protocol):
    """One rank's view of its world: where it runs, symmetric memory, device communicators,
    compiled kernels, barriers and the stream gate the timer uses."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_cuda(self) -> bool: ...

    @property
    def group(self) -> Any: ...  # torch.distributed's group, for host baselines

    @property
    def group_name(self) -> str: ...

    def stream(self, name: str, priority: int = 0) -> torch.cuda.Stream: ...

    def barrier(self) -> None: ...

    def synchronize(self) -> None: ...

    def compile(self, source: str, label: str = "candidate") -> Any: ...

    def symmetric(self, shape: tuple[int, ...] | list[int] | int, dtype: torch.dtype, zero: bool = True) -> torch.Tensor: ...

    def symmetric_bytes_in_use(self) -> int: ...

    def window(self, tensor: torch.Tensor) -> Any: ...

    def peer_ptrs(self, tensor: torch.Tensor) -> list[int]: ...

    def peer_tensor(self, tensor: torch.Tensor, rank: int) -> torch.Tensor: ...

    def dev_comm(self, lsa_barriers: int = 1, gin_signals: int = 0, gin_counters: int = 0) -> Any: ...

    def device_barrier(self, stream: torch.cuda.Stream | None = None) -> None: ...

    def hold_stream(self, timeout_s: float = 0.05, stream: torch.cuda.Stream | None = None) -> Callable[[], None]: ...

    def end_candidate(self) -> None: ...
