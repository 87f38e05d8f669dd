"""Where the device collectives' packed bytes live, how a peer's are read, and the barrier.

`Transport` is the interface the algorithms (`device.DeviceCollectives`) use, so that they run on
CPU tests too (tests/taco_jobs.FakeNode: ranks as threads). `WindowTransport` is the real one: a
RankContext's symmetric windows, read by the kernels over NVLink, and its LSA barrier.
"""

from __future__ import annotations

from typing import Any, Hashable, Protocol

import torch

from commweave.runtime.launch import current_stream_handle
from commweave.taco.cuda import FusedBarrier


class Transport(Protocol):
    """One buffer per rank per key, peers' readable, and a barrier across the ranks."""

    rank: int
    world_size: int
    device: torch.device

    def buffer(self, key: Hashable, nbytes: int) -> torch.Tensor:
        """This rank's uint8 buffer of `nbytes` for `key`, made once (collective the first time)."""
        ...

    def peer(self, buf: torch.Tensor, rank: int) -> torch.Tensor:
        """`buf`'s counterpart in `rank`'s memory (rank == self.rank: buf itself), readable here."""
        ...

    def barrier(self) -> None:
        """All ranks: writes issued before it are visible to reads issued after it, everywhere."""
        ...

    def capturing(self) -> bool:
        """Work queued now goes into a CUDA graph (replayed later, any number of times)."""
        ...

    def fused_barrier(self, epoch: int) -> FusedBarrier | None:
        """The same barrier for the next reading kernel to perform itself (`epoch`: this barrier's
        number, identical on every rank and growing), or None where it cannot (then `barrier()`)."""
        ...


class WindowTransport:
    """A RankContext's symmetric windows: buffers from `ctx.symmetric`, peers' via `ctx.peer_tensor`
    (NVLink loads by the kernels), barrier `ctx.device_barrier()` (LSA, acq_rel) on the current
    stream. Calls on different streams are ordered (the later stream waits on the earlier one): the
    windows are not torch allocations, so torch would not order them."""

    def __init__(self, ctx: Any):
        self.ctx = ctx
        self.rank, self.world_size, self.device = ctx.rank, ctx.world_size, ctx.device
        self._buffers: dict[Hashable, torch.Tensor] = {}
        self._peers: dict[tuple[int, int, int], torch.Tensor] = {}
        self._stream: torch.cuda.Stream | None = None  # the stream of the last call
        self._flags: torch.Tensor | None = None  # [W] int64: word s = the last barrier rank s signalled here
        self._flag_peers: list[int] = []  # each rank's flag words' address, as mapped here

    def buffer(self, key: Hashable, nbytes: int) -> torch.Tensor:
        capturing = self.capturing()
        if key not in self._buffers:
            if capturing:
                raise ValueError("the first call of a collective's layout allocates symmetric windows, which a CUDA "
                                 "graph capture cannot do: make that call once before capturing (a warm-up)")
            self._buffers[key] = self.ctx.symmetric(nbytes, torch.uint8, zero=False)  # collective
        # the previous call's reads of our windows come first; not under capture, where waiting on
        # uncaptured work is illegal (torch synchronizes the device before it captures)
        if not capturing and (self._stream is None or current_stream_handle(self.device.index) != self._stream.cuda_stream):
            stream = torch.cuda.current_stream(self.device)
            if self._stream is not None:
                stream.wait_stream(self._stream)
            self._stream = stream
        return self._buffers[key]

    def peer(self, buf: torch.Tensor, rank: int) -> torch.Tensor:
        if rank == self.rank:
            return buf
        k = (buf.data_ptr(), buf.numel(), rank)
        if k not in self._peers:
            self._peers[k] = self.ctx.peer_tensor(buf, rank)
        return self._peers[k]

    def barrier(self) -> None:
        self.ctx.device_barrier()

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def fused_barrier(self, epoch: int) -> FusedBarrier | None:
        """Signal this rank's word in every peer's flags, wait for every peer's word here. None
        while the stream is captured into a CUDA graph (the epoch is a host value that a replay
        would repeat): then a barrier kernel."""
        if self.capturing():
            return None
        if self._flags is None:  # collective, at the first fused barrier (the same call on every rank)
            self._flags = self.ctx.symmetric(self.world_size, torch.int64)
            self._flag_peers = [self.peer(self._flags, p).data_ptr() for p in range(self.world_size)]
        others = [p for p in range(self.world_size) if p != self.rank]
        return FusedBarrier(signal=tuple(self._flag_peers[d] + 8 * self.rank for d in others),
                            wait=tuple(self._flags.data_ptr() + 8 * s for s in others), epoch=epoch)
