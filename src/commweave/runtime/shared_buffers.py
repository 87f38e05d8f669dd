"""Buffers a judge owns and shares with one program process: its inputs and its output.

The judge allocates one block per program and rank, views tensors into it by a layout, and hands
the block to the program process once: on CPU an anonymous memfd (no name anyone else could open)
sent as a file descriptor over their unix socket (runtime/wire.py) and mapped on both sides; on GPUs a CUDA
allocation of a memory pool of its own, exported by CUDA IPC (torch's reductions). The judge then writes fresh values, poisons
the output and reads it back in its own process; the program process only ever sees this block.

torch frees a block it exported only once every process that mapped it has returned its reference
(a counter in a shared-memory file). A program process is killed, so it never returns it, and each
block would stay allocated in the judge for good (~7 GiB a ParallelKernelBench problem on one GPU,
until the judge ran out of memory). The judge therefore voids that reference itself once the
program process is dead (`SharedBuffers.close`).
"""

from __future__ import annotations

import mmap
import os
import sys
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers the CUDA IPC reductions ForkingPickler uses)
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from commweave.runtime.wire import Channel, decode_bytes, encode_bytes

ALIGN = 256  # bytes: every view starts aligned for vector loads and TMA
# torch's CUDA IPC reference counters: one int64 per exported allocation, after the 64-byte header
# of ATen's shared-memory file (MapAllocator), named by the handle the reduction carries
COUNTER_HEADER, COUNTER_BYTES = 64, 8


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
        self._reference: IpcReference | None = None
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
            rebuild, args = reduce_tensor(self.block)
            if rebuild is not rebuild_cuda_tensor or self._reference is not None:
                raise RuntimeError("a judge's GPU block is exported once, by torch's CUDA IPC reduction")
            self._reference = IpcReference(args[11], args[12])  # rebuild_cuda_tensor's ref_counter_handle, _offset
            channel.send({"kind": "cuda", "slots": slots, "nbytes": self.nbytes,
                          "payload": encode_bytes(bytes(ForkingPickler.dumps(Reduced(rebuild, args))))})
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
        """Drop the judge's handles (the mapping goes with the last tensor viewing it). Call it once
        the process the block was sent to is dead: its IPC reference is voided, so the block is freed
        now instead of waiting in torch's limbo for a release that never comes. With no view of the
        block left elsewhere, its memory pool then returns it to the device (a view that outlives
        the pool leaves the block cached in the judge until the allocator next empties its cache)."""
        if self._reference is not None:
            self._reference.void()
            self._reference = None
        self.tensors = {}
        self.block = None
        self._map = None
        self._pool = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Reduced:
    """Pickles as the given reduction (a CUDA tensor's, made beforehand: here so its counter is
    known; in the problem service before torch.save sends it)."""

    def __init__(self, rebuild: Any, args: tuple):
        self.reduction = (rebuild, args)

    def __reduce__(self) -> tuple:
        return self.reduction


class IpcReference:
    """The count torch keeps, in a shared-memory file, of the references other processes hold to
    an allocation this process exported by CUDA IPC: 1 once exported, until the importer frees its
    tensor. Mapped here so the exporter can void it when the importer died without freeing."""

    def __init__(self, handle: bytes, index: int):
        fd = os.open("/dev/shm/" + handle.decode().lstrip("/"), os.O_RDWR)
        try:
            self._file = mmap.mmap(fd, COUNTER_HEADER + (index + 1) * COUNTER_BYTES)
        finally:
            os.close(fd)
        self._at = COUNTER_HEADER + index * COUNTER_BYTES
        if self.count != 1:
            raise RuntimeError(f"torch's CUDA IPC reference counter reads {self.count} right after export, not 1: "
                               f"its layout changed (commweave reads a uint64 at {COUNTER_HEADER} + 8 x index)")

    @property
    def count(self) -> int:
        return int.from_bytes(self._file[self._at:self._at + COUNTER_BYTES], sys.byteorder, signed=True)

    def void(self) -> None:
        """No process holds the allocation any more (whatever its importer wrote to the counter)."""
        self._file[self._at:self._at + COUNTER_BYTES] = bytes(COUNTER_BYTES)
        self._file.close()


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
