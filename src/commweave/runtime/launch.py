"""Load cubins and launch their kernels on torch streams.

We use the driver API through cuda-python (`cuda.bindings.driver`) rather than cuda.core or cupy:
it loads a cubin into the primary context torch already uses (no second allocator or context), it
reports each kernel parameter's size (`cuFuncGetParamInfo`), so arguments are packed and checked
against the compiled signature instead of trusted, and it passes an opaque struct such as
`ncclDevComm` by value as raw bytes, which cuda.core's typed launch does not.
"""

from __future__ import annotations

import ctypes
import itertools
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from commweave.runtime.nccl import DevComm, Window


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
    take the parameter's width; ctypes and numpy scalars must already have it.
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
    elif isinstance(value, ctypes._SimpleCData | ctypes.Structure | ctypes.Array):
        raw = bytes(value)
    elif hasattr(value, "tobytes") and hasattr(value, "dtype"):  # numpy scalar
        raw = value.tobytes()
    else:
        raise LaunchError(f"{where} has unsupported type {type(value).__name__}")
    if len(raw) != size:
        raise LaunchError(f"{where} packs to {len(raw)} bytes but the kernel's parameter has {size}")
    return raw


class Kernel:
    """One `extern "C" __global__` function of a loaded module."""

    def __init__(self, function: Any, name: str):
        self.function = function
        self.name = name
        self.param_sizes = self._param_sizes()

    def _param_sizes(self) -> list[int]:
        drv = _driver()
        sizes = []
        while True:
            err, _offset, size = drv.cuFuncGetParamInfo(self.function, len(sizes))
            if int(err) != 0:
                return sizes
            sizes.append(size)

    def set_max_dynamic_shared_memory(self, nbytes: int) -> None:
        drv = _driver()
        attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(drv.cuFuncSetAttribute(self.function, attr, nbytes), f"cuFuncSetAttribute({self.name})")

    def launch(self, grid: int | Sequence[int], block: int | Sequence[int], args: Sequence[Any],
               stream: Any = None, shared_mem: int = 0) -> None:
        """Launch on `stream` (a torch.cuda.Stream; default: torch's current stream)."""
        import torch

        if len(args) != len(self.param_sizes):
            raise LaunchError(f"{self.name} takes {len(self.param_sizes)} arguments, got {len(args)}")
        packed = [pack_argument(a, s, i, self.name) for i, (a, s) in enumerate(zip(args, self.param_sizes))]
        # every argument's bytes in one buffer, each at an 8-byte aligned offset; the driver reads
        # param_sizes[i] bytes at pointers[i] (one allocation a launch instead of one per argument)
        slots = [-(-len(raw) // 8) * 8 for raw in packed]
        blob = ctypes.create_string_buffer(b"".join(raw.ljust(n, b"\0") for raw, n in zip(packed, slots)),
                                           max(sum(slots), 1))
        base = ctypes.addressof(blob)
        pointers = (ctypes.c_void_p * max(1, len(packed)))(*[base + o for o in itertools.accumulate([0, *slots[:-1]])])
        g = (grid, 1, 1) if isinstance(grid, int) else tuple(grid) + (1,) * (3 - len(grid))
        b = (block, 1, 1) if isinstance(block, int) else tuple(block) + (1,) * (3 - len(block))
        stream = stream if stream is not None else torch.cuda.current_stream()
        drv = _driver()
        _check(drv.cuLaunchKernel(self.function, *g, *b, shared_mem, drv.CUstream(stream.cuda_stream),
                                  ctypes.addressof(pointers), 0), f"cuLaunchKernel({self.name})")

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
    import torch

    drv = _driver()
    stream = stream if stream is not None else torch.cuda.current_stream()
    _check(drv.cuStreamWriteValue64(drv.CUstream(stream.cuda_stream), drv.CUdeviceptr(address), drv.cuuint64_t(value),
                                    int(drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)), "cuStreamWriteValue64")


def stream_wait_geq(address: int, value: int, stream: Any = None) -> None:
    """Block `stream` (default: torch's current) until the 64-bit word at `address` is >= `value`.

    A stream memory operation: the GPU's front end waits, no kernel launch and no SM is taken, so
    a GEMM queued behind it starts as soon as a peer's flag arrives."""
    import torch

    drv = _driver()
    stream = stream if stream is not None else torch.cuda.current_stream()
    geq = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    _check(drv.cuStreamWaitValue64(drv.CUstream(stream.cuda_stream), drv.CUdeviceptr(address), drv.cuuint64_t(value),
                                   int(geq)), "cuStreamWaitValue64")
