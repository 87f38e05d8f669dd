"""Load cubins and launch their kernels on torch streams.

We use the driver API through cuda-python (`cuda.bindings.driver`) rather than cuda.core or cupy:
it loads a cubin into the primary context torch already uses (no second allocator or context), it
reports each kernel parameter's size (`cuFuncGetParamInfo`), so arguments are packed and checked
against the compiled signature instead of trusted, and it passes an opaque struct such as
`ncclDevComm` by value as raw bytes, which cuda.core's typed launch does not.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from commweave.runtime.nccl import DevComm, Window


def current_stream_handle(device_index: int | None = None) -> int:
    """The raw handle of torch's current stream on `device_index` (default: the current device), as
    `torch.cuda.current_stream(device).cuda_stream` gives it but without building a Stream object and
    resolving the device through Python (~10 µs a call on the GPU machine's host, paid by every
    launch of a per-call collective)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:  # a torch without CUDA: the public path (it raises the usual error)
        return torch.cuda.current_stream(device_index).cuda_stream
    return raw(torch._C._cuda_getDevice() if device_index is None else device_index)


def on_device(device: Any) -> contextlib.AbstractContextManager:
    """`torch.cuda.device(device)` for a CUDA device (a torch.device or an index) that is not the
    current one; nothing otherwise (CPU, or already current: the usual case, one GPU per process),
    which spares a per-call collective torch's Python device resolution (~10 µs on the GPU machine)."""
    import torch

    if isinstance(device, int):
        index = device
    elif device.type == "cuda":
        index = device.index
    else:
        return contextlib.nullcontext()
    get = getattr(torch._C, "_cuda_getDevice", None)
    if index is not None and get is not None and get() == index:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


class LaunchError(RuntimeError):
    """A kernel could not be loaded or launched (bad arguments, driver error)."""


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise LaunchError("cuda-python is not installed (`pip install cuda-bindings`)") from exc
    return driver


def _check(result: tuple, call: str) -> Any:
    err = result[0]
    if int(err) != 0:
        drv = _driver()
        _, name = drv.cuGetErrorName(err)
        _, text = drv.cuGetErrorString(err)
        raise LaunchError(f"{call} failed: {name.decode() if name else err} ({text.decode() if text else ''})")
    return result[1] if len(result) == 2 else result[1:]


def pack_argument(value: Any, size: int, index: int, kernel: str) -> bytes:
    """One kernel argument as the bytes the kernel's parameter of `size` bytes expects.

    Tensors and windows become 8-byte addresses, a DevComm its whole struct; Python ints and floats
    take the parameter's width; ctypes values, bytes and numpy scalars must already have it.
    """
    if type(value) is int and size in (1, 2, 4, 8):  # the common case first: launches are per call
        try:
            return value.to_bytes(size, "little", signed=value < 0)
        except OverflowError as exc:
            raise LaunchError(f"{kernel}: argument {index}: {value} does not fit the {size}-byte parameter") from exc
    where = f"{kernel}: argument {index}"
    if hasattr(value, "data_ptr") and callable(value.data_ptr):  # torch.Tensor
        raw = struct.pack("<Q", value.data_ptr())
    elif isinstance(value, Window):
        raw = struct.pack("<Q", value.handle)
    elif isinstance(value, DevComm):
        raw = bytes(value.blob)
    elif isinstance(value, bool):
        raw = int(value).to_bytes(size, "little") if size in (1, 2, 4, 8) else b""
    elif isinstance(value, int):
        if size not in (1, 2, 4, 8):
            raise LaunchError(f"{where} is an int but the parameter has {size} bytes")
        signed = value < 0
        try:
            raw = value.to_bytes(size, "little", signed=signed)
        except OverflowError as exc:
            raise LaunchError(f"{where}: {value} does not fit the {size}-byte parameter") from exc
    elif isinstance(value, float):
        if size == 4:
            raw = struct.pack("<f", value)
        elif size == 8:
            raw = struct.pack("<d", value)
        else:
            raise LaunchError(f"{where} is a float but the parameter has {size} bytes")
    elif isinstance(value, ctypes._SimpleCData | ctypes.Structure | ctypes.Array | bytes):
        raw = bytes(value)
    elif hasattr(value, "tobytes") and hasattr(value, "dtype"):  # numpy scalar
        raw = value.tobytes()
    else:
        raise LaunchError(f"{where} has unsupported type {type(value).__name__}")
    if len(raw) != size:
        raise LaunchError(f"{where} packs to {len(raw)} bytes but the kernel's parameter has {size}")
    return raw


_STRUCT_CODES = {(int, 1): "b", (int, 2): "h", (int, 4): "i", (int, 8): "q", (float, 4): "f", (float, 8): "d"}


def _address(value: Any) -> int:
    return value.data_ptr()


def _window(value: Window) -> int:
    return value.handle


def _dev_comm(value: DevComm) -> bytes:
    return bytes(value.blob)


@dataclass(frozen=True)
class _Packer:
    """Every argument of one combination of types written by one struct: ints and floats at their
    parameter's width, tensors and windows as 8-byte addresses, a DevComm, bytes and ctypes values
    as their bytes. `convert`: (index, function) of the arguments to convert first; `sized`: the
    indices whose bytes must be exactly the parameter's size (the struct would pad or cut them)."""

    writer: struct.Struct
    convert: tuple[tuple[int, Any], ...]
    sized: tuple[int, ...]


class Kernel:
    """One `extern "C" __global__` function of a loaded module."""

    def __init__(self, function: Any, name: str):
        self.function = function
        self.name = name
        self.param_sizes = self._param_sizes()
        self._layout()

    def _param_sizes(self) -> list[int]:
        drv = _driver()
        sizes = []
        while True:
            err, _offset, size = drv.cuFuncGetParamInfo(self.function, len(sizes))
            if int(err) != 0:
                return sizes
            sizes.append(size)

    def _layout(self) -> None:
        """Every argument's bytes go into one buffer made once per kernel, each at an 8-byte
        aligned slot, with the driver's array of pointers into it: the driver copies the arguments
        when the launch is queued, so the buffer is reused (a launch is paid per call by the
        collectives; building both per launch was a third of its host time)."""
        slots = [-(-size // 8) * 8 for size in self.param_sizes]
        self._padding = [b"\0" * (n - size) for n, size in zip(slots, self.param_sizes)]
        self._blob = ctypes.create_string_buffer(max(sum(slots), 1))
        base = ctypes.addressof(self._blob)
        offsets = itertools.accumulate([0, *slots[:-1]])
        self._pointers = (ctypes.c_void_p * max(1, len(slots)))(*[base + o for o in offsets])
        self._pointers_address = ctypes.addressof(self._pointers)
        self._lock = threading.Lock()  # one launch at a time fills the shared buffer
        self._packers: dict[tuple[type, ...], _Packer | None] = {}

    def _packer(self, kinds: tuple[type, ...]) -> _Packer | None:
        """The struct for arguments of these types (the types a call site passes do not change
        from call to call); None where a type has no struct form (then `pack_argument`)."""
        fmt, convert, sized = "<", [], []
        for i, (kind, size, pad) in enumerate(zip(kinds, self.param_sizes, self._padding)):
            if (kind, size) in _STRUCT_CODES:
                fmt += _STRUCT_CODES[kind, size]
            elif size == 8 and (kind is Window or callable(getattr(kind, "data_ptr", None))):  # window, tensor
                fmt += "Q"
                convert.append((i, _window if kind is Window else _address))
            elif kind is DevComm or kind is bytes or issubclass(kind, ctypes.Structure | ctypes.Array):
                fmt += f"{size}s"
                convert.append((i, _dev_comm if kind is DevComm else bytes))
                sized.append(i)
            else:
                return None
            fmt += f"{len(pad)}x" if pad else ""
        return _Packer(struct.Struct(fmt), tuple(convert), tuple(sized))

    def _fill(self, args: Sequence[Any]) -> None:
        """The arguments' bytes into the buffer: by the packer of their types when they fit it (an
        int out of its struct code's range, e.g. an unsigned value above the signed one, or bytes
        of another length, take the general path, which also names what is wrong)."""
        kinds = tuple(map(type, args))
        packer = self._packers.get(kinds, False)
        if packer is False:
            packer = self._packers[kinds] = self._packer(kinds)
        if packer is not None:
            values = list(args)
            for i, function in packer.convert:
                values[i] = function(args[i])
            if all(len(values[i]) == self.param_sizes[i] for i in packer.sized):
                try:
                    packer.writer.pack_into(self._blob, 0, *values)
                    return
                except (struct.error, OverflowError):
                    pass
        packed = b"".join([part for i, (a, size, pad) in enumerate(zip(args, self.param_sizes, self._padding))
                           for part in (pack_argument(a, size, i, self.name), pad)])
        ctypes.memmove(self._blob, packed, len(packed))

    def set_max_dynamic_shared_memory(self, nbytes: int) -> None:
        drv = _driver()
        attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(drv.cuFuncSetAttribute(self.function, attr, nbytes), f"cuFuncSetAttribute({self.name})")

    def launch(self, grid: int | Sequence[int], block: int | Sequence[int], args: Sequence[Any],
               stream: Any = None, shared_mem: int = 0) -> None:
        """Launch on `stream` (a torch.cuda.Stream; default: torch's current stream)."""
        if len(args) != len(self.param_sizes):
            raise LaunchError(f"{self.name} takes {len(self.param_sizes)} arguments, got {len(args)}")
        g = (grid, 1, 1) if isinstance(grid, int) else tuple(grid) + (1,) * (3 - len(grid))
        b = (block, 1, 1) if isinstance(block, int) else tuple(block) + (1,) * (3 - len(block))
        handle = stream.cuda_stream if stream is not None else current_stream_handle()
        drv = _driver()
        with self._lock:
            self._fill(args)
            _check(drv.cuLaunchKernel(self.function, *g, *b, shared_mem, drv.CUstream(handle),
                                      self._pointers_address, 0), f"cuLaunchKernel({self.name})")

    __call__ = launch


class Module:
    """A cubin loaded into the current device's primary context (the one torch uses)."""

    def __init__(self, cubin: Path | bytes, label: str = "module"):
        drv = _driver()
        _check(drv.cuInit(0), "cuInit")
        data = cubin.read_bytes() if isinstance(cubin, Path) else cubin
        self.label = label
        self.handle = _check(drv.cuModuleLoadData(data), f"cuModuleLoadData({label})")
        self._kernels: dict[str, Kernel] = {}

    def kernel(self, name: str) -> Kernel:
        if name not in self._kernels:
            drv = _driver()
            try:
                fn = _check(drv.cuModuleGetFunction(self.handle, name.encode()), f"cuModuleGetFunction({name})")
            except LaunchError as exc:
                raise LaunchError(f"{self.label} has no kernel named {name!r} (declare it extern \"C\")") from exc
            self._kernels[name] = Kernel(fn, name)
        return self._kernels[name]

    def __getattr__(self, name: str) -> Kernel:
        if name.startswith("_") or name in ("handle", "label"):
            raise AttributeError(name)
        return self.kernel(name)


def stream_write(address: int, value: int, stream: Any = None) -> None:
    """Queue on `stream` (default: torch's current) a write of the 64-bit `value` to `address`
    (a local or a peer's mapped word), after everything queued before it has completed.

    A stream memory operation with the default memory barrier, so a peer that sees the value
    (`stream_wait_geq`) also sees the data earlier copies on this stream wrote. No kernel, no SM."""
    drv = _driver()
    handle = stream.cuda_stream if stream is not None else current_stream_handle()
    _check(drv.cuStreamWriteValue64(drv.CUstream(handle), drv.CUdeviceptr(address), drv.cuuint64_t(value),
                                    int(drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)), "cuStreamWriteValue64")


def stream_wait_geq(address: int, value: int, stream: Any = None) -> None:
    """Block `stream` (default: torch's current) until the 64-bit word at `address` is >= `value`.

    A stream memory operation: the GPU's front end waits, no kernel launch and no SM is taken, so
    a GEMM queued behind it starts as soon as a peer's flag arrives."""
    drv = _driver()
    handle = stream.cuda_stream if stream is not None else current_stream_handle()
    geq = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    _check(drv.cuStreamWaitValue64(drv.CUstream(handle), drv.CUdeviceptr(address), drv.cuuint64_t(value),
                                   int(geq)), "cuStreamWaitValue64")
