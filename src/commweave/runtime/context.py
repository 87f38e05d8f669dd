"""The handle a candidate program gets on one rank: `ctx`.

It owns this rank's NCCL communicator, its symmetric windows (kept alive and reused across
candidates, because registering a window is a slow collective), device communicators (per
candidate, so a broken candidate's barrier state never leaks into the next), compiled modules and
side streams. Every allocation or creation here that talks to peers is collective: all ranks call
it with the same arguments in the same order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from commweave.runtime.compile import compile_cubin
from commweave.runtime.launch import Module
from commweave.runtime.nccl import KERNELS_DIR, Communicator, DevComm, Window

ALLOC_GRANULARITY = 2 << 20  # symmetric allocations are rounded to 2 MiB so they can be reused
MAX_CACHED_BYTES = 16 << 30  # free windows kept for later candidates, at most


class RuntimeUnavailable(RuntimeError):
    """The operation needs CUDA GPUs and NCCL's device API, and this context has none."""


class _DeviceMemory:
    """Exposes raw device memory to torch through the CUDA array interface (no copy)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None, "stream": None,
        }


@dataclass
class _SymmetricAllocation:
    ptr: int
    nbytes: int
    window: Window
    storage: torch.Tensor  # uint8 view over the whole allocation


class RankContext:
    """One rank's runtime: rank, world size, device, streams, symmetric memory, kernels."""

    def __init__(self, rank: int, world_size: int, device: torch.device, comm: Communicator | None,
                 cpu_group: Any = None, group: Any = None, owns_comm: bool = True):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.comm = comm
        self.cpu_group = cpu_group
        self._group = group  # None: torch.distributed's default group
        self._owns_comm = owns_comm  # False: torch's own communicator, which torch destroys
        self._streams: dict[str, torch.cuda.Stream] = {}
        self._modules: dict[Path, Module] = {}
        self._in_use: list[_SymmetricAllocation] = []
        self._free: list[_SymmetricAllocation] = []
        self._candidate_dev_comms: list[DevComm] = []
        self._harness_dev_comm: DevComm | None = None
        self._helpers_module: Module | None = None
        self._gate_flag: torch.Tensor | None = None  # hold_stream(): pinned host flag, polled by the GPU
        self._gate_count = 0
        self._peer_ptr_cache: dict[tuple[int, int], list[int]] = {}

    @classmethod
    def from_process_group(cls, device: torch.device | str | None = None, group: Any = None,
                           torch_comm: bool = False) -> RankContext:
        """This rank's context over one of torch.distributed's process groups (collective over its
        members): `group` None is the default group; any other is a group this rank belongs to, and
        only its members call this. The worker pool builds its contexts this way, and so do users'
        own distributed programs (`commweave.ops`, one context per group).

        `device` defaults to the current CUDA device when the group has NCCL for CUDA, else the
        CPU. On CUDA the device API needs a raw `ncclComm_t` over exactly the group's ranks: with
        `torch_comm` it is torch's own communicator of the group, where the build exposes it
        (`ProcessGroupNCCL._comm_ptr()`; torch keeps ownership), else a communicator of our own
        whose unique id is broadcast over the group's host side. The host side (`cpu_group`:
        `barrier()`, setup's agreement checks) is a gloo group made with `new_group` for the
        default group (a collective of every rank); for a subgroup, whose peers outside it are busy
        with their own groups, it is the group itself. On CPU there is no communicator.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group() "
                               "first (one process per GPU; NCCL on CUDA, gloo on CPU)")
        world = group is None or group is dist.group.WORLD
        pg = dist.group.WORLD if world else group
        if not world and dist.get_rank(pg) < 0:
            raise ValueError(f"this rank ({dist.get_rank()}) is not a member of process group {pg.group_name!r}")
        config = dist.get_backend_config(pg)
        backends = dict(pair.split(":", 1) for pair in config.split(",") if ":" in pair)
        if device is None:
            use_cuda = torch.cuda.is_available() and backends.get("cuda") == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        want = {"cuda": "nccl", "cpu": "gloo"}.get(device.type)
        if want is None:
            raise ValueError(f"commweave runs on CUDA GPUs or the CPU, not {device}")
        if backends.get(device.type) != want:
            raise ValueError(f"{device.type} tensors need the process group to use {want} for {device.type} "
                             f"(its backends are {config!r})")
        rank, world_size = dist.get_rank(pg), dist.get_world_size(pg)
        cpu_group = dist.new_group(backend="gloo") if world else pg
        comm, owned = None, True
        if device.type == "cuda":
            from commweave.runtime import nccl

            with torch.cuda.device(device):  # ncclCommInitRank binds the current device
                borrowed = _torch_comm(pg, device) if torch_comm else None
                if borrowed is not None:
                    comm, owned = nccl.Communicator(borrowed, rank, world_size), False
                else:
                    uid = [nccl.unique_id() if rank == 0 else None]
                    dist.broadcast_object_list(uid, group_src=0, group=cpu_group)
                    comm = nccl.Communicator.init_rank(uid[0], rank, world_size)
        return cls(rank, world_size, device, comm, cpu_group, None if world else pg, owned)

    # -- basics ---------------------------------------------------------------------------------
    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def group(self) -> Any:
        """torch.distributed's group this context spans (NCCL on GPUs, gloo on CPU), for host
        baselines; `rank` and `world_size` are this rank's place in it."""
        return dist.group.WORLD if self._group is None else self._group

    @property
    def group_name(self) -> str:
        return self.group.group_name

    def _require_device_api(self, what: str) -> Communicator:
        if self.comm is None:
            raise RuntimeUnavailable(f"{what} needs CUDA GPUs and NCCL's device API; this rank runs on {self.device}")
        return self.comm

    def stream(self, name: str, priority: int = 0) -> torch.cuda.Stream:
        """A persistent side stream, created once per (name, priority). A negative priority is
        scheduled first: communication kernels that must not queue behind a GEMM's CTAs."""
        if not self.is_cuda:
            raise RuntimeUnavailable(f"stream({name!r}) needs CUDA")
        key = f"{name}@{priority}"
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=self.device, priority=priority)
        return self._streams[key]

    def barrier(self) -> None:
        """Host-side barrier across ranks (gloo: never queues work on a GPU stream)."""
        dist.barrier(group=self.cpu_group)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    # -- kernels --------------------------------------------------------------------------------
    def compile(self, source: str, label: str = "candidate") -> Module:
        """Compile (disk-cached by content) and load a CUDA source; kernels are `extern "C"`."""
        if not self.is_cuda:
            raise RuntimeUnavailable("compile() needs CUDA")
        path = compile_cubin(source).path
        if path not in self._modules:
            self._modules[path] = Module(path, label)
        return self._modules[path]

    def _helpers(self) -> Module:
        """The runtime's own kernels, loaded once (every timed iteration launches two of them)."""
        if self._helpers_module is None:
            self._helpers_module = self.compile((KERNELS_DIR / "lsa_helpers.cu").read_text(), "lsa_helpers")
        return self._helpers_module

    # -- symmetric memory -----------------------------------------------------------------------
    def symmetric(self, shape: tuple[int, ...] | list[int] | int, dtype: torch.dtype, zero: bool = True) -> torch.Tensor:
        """A tensor in a window registered on every rank (collective: same shape, same order).

        Zeroed by default, and ranks are lined up afterwards, so no peer writes into it before
        every rank has cleared it.
        """
        comm = self._require_device_api("symmetric()")
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = max(1, math.prod(shape)) * itemsize
        rounded = -(-nbytes // ALLOC_GRANULARITY) * ALLOC_GRANULARITY
        alloc = next((a for a in self._free if a.nbytes == rounded), None)
        if alloc is not None:
            self._free.remove(alloc)
        else:
            if sum(a.nbytes for a in self._free) + rounded > MAX_CACHED_BYTES:
                self._release_free_windows()
            ptr = comm.mem_alloc(rounded)
            window = comm.register_window(ptr, rounded)
            storage = torch.as_tensor(_DeviceMemory(ptr, rounded), device=self.device)
            alloc = _SymmetricAllocation(ptr, rounded, window, storage)
        self._in_use.append(alloc)
        tensor = alloc.storage[:nbytes].view(dtype).view(shape)
        if zero:
            alloc.storage.zero_()
            torch.cuda.synchronize(self.device)
            self.barrier()
        return tensor

    def symmetric_bytes_in_use(self) -> int:
        """Bytes of symmetric windows handed out since the last `end_candidate` (rounded up to the
        allocation granularity): memory programs hold outside torch's allocator."""
        return sum(a.nbytes for a in self._in_use)

    def _allocation_of(self, tensor: torch.Tensor) -> _SymmetricAllocation:
        ptr = tensor.data_ptr()
        for alloc in self._in_use:
            if alloc.ptr <= ptr < alloc.ptr + alloc.nbytes:
                return alloc
        raise ValueError("tensor is not in a symmetric window: allocate it with ctx.symmetric()")

    def window(self, tensor: torch.Tensor) -> Window:
        """The window holding `tensor`; `.offset` is the tensor's byte offset in it."""
        alloc = self._allocation_of(tensor)
        w = alloc.window
        return Window(w.handle, w.base_ptr, w.nbytes, offset=tensor.data_ptr() - alloc.ptr)

    def peer_ptrs(self, tensor: torch.Tensor) -> list[int]:
        """Addresses of `tensor` in every rank's window (index = rank), usable in this process:
        for Triton or raw-pointer kernels that load/store peers' memory over NVLink."""
        win = self.window(tensor)
        key = (win.handle, win.offset)
        if key not in self._peer_ptr_cache:
            out = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
            self._helpers().cw_peer_pointers(1, max(32, self.world_size), [win, win.offset, self.world_size, out])
            self._peer_ptr_cache[key] = [int(x) for x in out.tolist()]
        return self._peer_ptr_cache[key]

    def peer_tensor(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """`tensor`'s counterpart in `rank`'s window, as a tensor of this device (same shape and
        dtype, contiguous `tensor` only): for copies a copy engine makes over NVLink (`copy_` on a
        side stream), with no kernel of ours involved."""
        if not tensor.is_contiguous():
            raise ValueError("peer_tensor() needs a contiguous tensor")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a world of {self.world_size}")
        ptr = self.peer_ptrs(tensor)[rank]
        nbytes = tensor.numel() * tensor.element_size()
        return torch.as_tensor(_DeviceMemory(ptr, nbytes), device=self.device).view(tensor.dtype).view(tensor.shape)

    # -- device communicators -------------------------------------------------------------------
    def dev_comm(self, lsa_barriers: int = 1, gin_signals: int = 0, gin_counters: int = 0) -> DevComm:
        """A device communicator for this candidate (collective). `lsa_barriers` = how many CTAs
        may open LSA barrier sessions at once (index them by blockIdx.x)."""
        comm = self._require_device_api("dev_comm()")
        dc = comm.create_dev_comm(lsa_barriers=lsa_barriers, gin_signals=gin_signals, gin_counters=gin_counters)
        self._candidate_dev_comms.append(dc)
        return dc

    def device_barrier(self, stream: torch.cuda.Stream | None = None) -> None:
        """Queue a barrier across all ranks' GPUs on `stream` (default: current)."""
        comm = self._require_device_api("device_barrier()")
        if self._harness_dev_comm is None:
            self._harness_dev_comm = comm.create_dev_comm(lsa_barriers=1)
        self._helpers().cw_lsa_barrier(1, 128, [self._harness_dev_comm], stream=stream)

    def hold_stream(self, timeout_s: float = 0.05, stream: torch.cuda.Stream | None = None) -> Callable[[], None]:
        """Hold `stream` (default: current) until the returned release() is called, or `timeout_s`
        has passed on the GPU: the host queues a timed region behind it, so the region's work is
        queued before it starts. The flag is pinned host memory the gate kernel polls. (A kernel
        launched for the first time while the gate runs is loaded lazily by CUDA, which waits for
        the gate: the host then blocks until the timeout, once per kernel.)"""
        if not self.is_cuda:
            raise RuntimeUnavailable("hold_stream() needs CUDA")
        if self._gate_flag is None:
            self._gate_flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._gate_count += 1
        expected = self._gate_count
        self._helpers().cw_host_gate(1, 32, [self._gate_flag, expected, int(timeout_s * 1e9)], stream=stream)

        def release() -> None:
            self._gate_flag[0] = expected

        return release

    # -- lifetime -------------------------------------------------------------------------------
    def end_candidate(self) -> None:
        """Give back what a candidate took: windows go to the free list, device comms are destroyed.
        Deterministic, so every rank's cache stays identical."""
        self.synchronize()
        if self.comm is not None:
            for dc in self._candidate_dev_comms:
                self.comm.destroy_dev_comm(dc)
        self._candidate_dev_comms.clear()
        self._free.extend(self._in_use)
        self._in_use.clear()
        self._peer_ptr_cache.clear()
        for s in self._streams.values():
            s.synchronize()

    def _release_free_windows(self) -> None:
        assert self.comm is not None
        torch.cuda.synchronize(self.device)
        for alloc in self._free:
            self.comm.deregister_window(alloc.window)
            self.comm.mem_free(alloc.ptr)
        self._free.clear()

    def close(self) -> None:
        self.end_candidate()
        if self.comm is not None:
            self._release_free_windows()
            if self._owns_comm:
                self.comm.destroy()
            else:  # torch's communicator: only what we created on it goes
                for dc in list(self.comm._dev_comms):
                    self.comm.destroy_dev_comm(dc)
            self.comm = None


def _torch_comm(group: Any, device: torch.device) -> int | None:
    """The raw `ncclComm_t` of torch's NCCL backend of `group` on `device`, or None where this torch
    build does not expose it. A collective on the group first: torch creates communicators lazily."""
    try:
        backend = group._get_backend(device)
    except RuntimeError:
        return None
    comm_ptr = getattr(backend, "_comm_ptr", None)
    if comm_ptr is None:
        return None
    dist.barrier(group=group, device_ids=[device.index])
    return int(comm_ptr()) or None
