"""Buffers a judge owns and shares with one program process: its inputs and its output.

The judge allocates one block per program and rank, views tensors into it by a layout, and hands
the block to the program process once: on CPU an anonymous memfd (no name anyone else could open)
sent as a file descriptor over their unix socket (runtime/wire.py) and mapped on both sides; on GPUs a CUDA
allocation of a memory pool of its own, exported by CUDA IPC (torch's reductions). The judge then writes fresh values, poisons
the output and reads it back in its own process; the program process only ever sees this block.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401  (registers the CUDA IPC reductions ForkingPickler uses)

from commweave.runtime.wire import Channel, decode_bytes, encode_bytes

ALIGN = 256  # bytes: every view starts aligned for vector loads and TMA


@dataclass(frozen=True)
class Slot:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        count = 1
        for d in self.shape:
            count *= d
        return count * torch.empty((), dtype=self.dtype).element_size()


def layout(specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[Slot], int]:
    """Slots for `key -> (shape, dtype)`, each aligned, and the block's total size in bytes."""
    slots, offset = [], 0
    for key, (shape, dtype) in specs.items():
        slot = Slot(key, dtype, tuple(int(d) for d in shape), offset)
        slots.append(slot)
        offset += -(-max(1, slot.nbytes) // ALIGN) * ALIGN
    return slots, max(offset, ALIGN)


def views(block: torch.Tensor, slots: list[Slot]) -> dict[str, torch.Tensor]:
    return {s.key: block[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in slots}


class SharedBuffers:
    """Judge side: a block of `specs` on `device`, as named tensors (`.tensors`)."""

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device):
        self.slots, self.nbytes = layout(specs)
        self.device = device
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._pool: object = None
        if device.type == "cuda":
            # CUDA IPC maps the block's whole allocation: a pool of its own keeps every other tensor
            # of the judge (the next values, other programs' buffers) out of that allocation
            self._pool = torch.cuda.MemPool()
            with torch.cuda.use_mem_pool(self._pool, device=device):
                self.block = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        else:
            self._fd = os.memfd_create("commweave-buffers", os.MFD_CLOEXEC)
            os.ftruncate(self._fd, self.nbytes)
            self._map = mmap.mmap(self._fd, self.nbytes)
            self.block = torch.frombuffer(self._map, dtype=torch.uint8, count=self.nbytes)
        self.tensors = views(self.block, self.slots)

    def send(self, channel: Channel) -> None:
        """Give the block to the program process at the other end of `channel`: the layout as
        JSON, then the memfd (SCM_RIGHTS) or the CUDA IPC reduction (the judge's own pickle,
        base64; only a program process unpickles it, never the judge)."""
        slots = [[s.key, str(s.dtype).removeprefix("torch."), list(s.shape), s.offset] for s in self.slots]
        if self.device.type == "cuda":
            channel.send({"kind": "cuda", "slots": slots, "nbytes": self.nbytes,
                          "payload": encode_bytes(bytes(ForkingPickler.dumps(self.block)))})
        else:
            channel.send({"kind": "memfd", "slots": slots, "nbytes": self.nbytes})
            channel.send_fd(self._fd)

    def span(self, first: str, last: str) -> torch.Tensor:
        """The block's bytes from slot `first`'s start to slot `last`'s end, as one uint8 view
        (slots in between and their alignment padding included)."""
        by_key = {s.key: s for s in self.slots}
        begin, end = by_key[first].offset, by_key[last].offset + by_key[last].nbytes
        return self.block[begin:end]

    def close(self) -> None:
        """Drop the judge's handles (the mapping goes with the last tensor viewing it)."""
        self.tensors = {}
        self.block = None
        self._map = None
        self._pool = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def receive_buffers(channel: Channel) -> tuple[dict[str, torch.Tensor], object]:
    """Program side: the judge's block as named tensors, and what keeps the mapping alive."""
    message = channel.receive(None)
    slots = [Slot(key, getattr(torch, dtype), tuple(shape), offset) for key, dtype, shape, offset in message["slots"]]
    if message["kind"] == "cuda":
        block = ForkingPickler.loads(decode_bytes(message["payload"]))
        return views(block, slots), block
    fd = channel.receive_fd()
    mapping = mmap.mmap(fd, message["nbytes"])
    os.close(fd)
    block = torch.frombuffer(mapping, dtype=torch.uint8, count=message["nbytes"])
    return views(block, slots), mapping
