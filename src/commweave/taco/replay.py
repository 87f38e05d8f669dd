"""Recorded kernel launches, queued again for later calls of the same layout (CUDA codec).

Why: a call's Python (views of the output, the codec's argument checks), not its kernels, bounds a
model whose step is host-bound, and most of it depends only on the call's layout. So the first call
per (op, shape, dtype, cfg, buffer parity, 16-byte alignment of its tensors) runs the checked path
and records its launches (`cuda.recording`); later calls queue the same launches with their own
addresses, between the same barriers: byte for byte what the checked path would queue.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Hashable

import torch

from commweave.taco.cuda import Launch, recording, source_addresses, sources_arg


class Replays:
    """Recorded launches per replay key; `enabled` False (a per-message codec): nothing is replayed."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._launches: dict[Hashable, tuple[Launch, ...] | None] = {}  # None: that layout is not replayable

    def key(self, base: tuple, parity: int, *tensors: torch.Tensor) -> Hashable | None:
        """The key of the launches a call of buffer (*base, parity) reading and writing `tensors` may
        replay (the kernels' vector paths depend on the tensors' alignment); None where it may not:
        a tensor that is not contiguous is read by the checked path through a copy, a replay would
        read it at its own address."""
        if not self.enabled or not all(t.is_contiguous() for t in tensors):
            return None
        return (*base, parity, *(t.data_ptr() % 16 for t in tensors))

    def get(self, key: Hashable | None) -> tuple[Launch, ...] | None:
        return self._launches.get(key) if key is not None else None

    @contextmanager
    def recording(self, key: Hashable | None, *kernels: str) -> Iterator[None]:
        """Runs the checked path; the first time for `key`, keeps its launches when they are those of
        `kernels`, in order (else none: e.g. an empty message launches nothing, and one rank's sums
        are copies)."""
        if key is None or key in self._launches:
            yield
            return
        with recording() as launched:
            yield
        self._launches[key] = tuple(launched) if tuple(la.kernel.name for la in launched) == kernels else None

    def __len__(self) -> int:
        """Layouts recorded (replayable or not)."""
        return len(self._launches)

    def replayable(self) -> int:
        """Layouts recorded with launches to replay."""
        return sum(v is not None for v in self._launches.values())

    def clear(self) -> None:
        self._launches.clear()


def sum_with_own(launch: Launch, own: int, rank: int, world: int, **values: int | bytes) -> None:
    """A replayed sum whose sources hold this rank's own chunk raw (a reduce-scatter's, two-shot's
    first phase): that address is the call's, the peers' messages are the buffers' as recorded."""
    sources = source_addresses(launch.value("sources"), world)
    sources[rank] = own
    launch(sources=sources_arg(sources), **values)
