"""The device collectives' buffers: one per (op, shape, dtype, cfg), or two alternated by call
parity (double buffering), and every rank's packed views of them.

Why two: back-to-back single-phase calls (all-gather, reduce-scatter, one-shot) on one buffer
need a barrier before each rewrite besides the one before each read (`hazards`); with two, the
other call's read barrier covers the rewrite: one barrier a call, at twice the symmetric memory.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Hashable

import torch

from commweave.taco.transport import Transport
from commweave.taco.wire import Compressed, QuantConfig, packed_view


class Buffers:
    """Buffers of a Transport keyed by (op, shape, dtype, cfg, parity); views made once each."""

    def __init__(self, transport: Transport, double: bool):
        self.t = transport
        self.double = double
        self._calls: dict[Hashable, int] = defaultdict(int)
        # every rank's packed views of a buffer's bytes, made once (W views a call cost host time)
        self._views: dict[tuple, list[Compressed]] = {}

    def parity(self, base: tuple) -> int:
        """Which of base's two buffers its next call takes (0 single-buffered)."""
        return self._calls[base] % 2 if self.double else 0

    def take(self, base: tuple, nbytes: int) -> tuple[Hashable, torch.Tensor]:
        """This call's buffer for base = (op, shape, dtype, cfg), and its key."""
        key = (*base, self.parity(base))
        self._calls[base] += 1
        return key, self.t.buffer(key, nbytes)

    def messages(self, buf: torch.Tensor, lo: int, hi: int, shape: tuple[int, ...], dtype: torch.dtype,
                 cfg: QuantConfig) -> list[Compressed]:
        """Bytes [lo, hi) of every rank's counterpart of `buf` (rank order), as packed messages read in place."""
        key = (buf.data_ptr(), lo, hi, shape, dtype, cfg)
        if key not in self._views:
            self._views[key] = [packed_view(self.t.peer(buf, p)[lo:hi], shape, dtype, cfg)
                                for p in range(self.t.world_size)]
        return self._views[key]

    def clear(self) -> None:
        self._views.clear()
