"""TACO's quantizer as CUDA kernels (`taco_kernels.cu`): compress, and decompress that gathers or
sums several packed messages (peers' windows included) in one launch.

Why beside the Triton kernels (`kernels.py`): their butterflies reshape/permute a [rows, G] tile,
which Triton lowers to shared-memory round trips; here a lane holds 32 contiguous elements and a
group spans G/32 lanes, so most butterflies are in registers and the rest warp shuffles (2x faster
compression at TACO's defaults, NOTES.md). The collectives also want what one Triton launch per peer
cannot give: one kernel reading every rank's message, summing in FP32 in rank order and casting once
(no FP32 accumulator in memory), a reduce-scatter's own chunk added raw, two-shot's requantization
in the same pass.

Same bits as `quant.py` for every QuantConfig (see the .cu's header for how); the GPU tests check
it against the reference. One cubin per (config, input or output dtype, sources summed), compiled
by `runtime.compile` on first use (disk-cached) and loaded once per device.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from commweave.runtime.launch import on_device
from commweave.taco.wire import Compressed, QuantConfig, pack, packed_view

SOURCE = Path(__file__).with_name("taco_kernels.cu")
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_FMT_CODE = {"e4m3": 0, "e5m2": 1}
_HADAMARD_CODE = {False: 0, True: 1, "adaptive": 2}
MAX_SOURCES = 8  # `Sources` in the .cu
THREADS = 256
# register budget per kernel: blocks of THREADS resident per SM (more: more warps to hide latency,
# fewer registers; measured with bench/taco_codec.py and probe_taco_kernels.py (removed after 49add32): compress is fastest
# at 2 (3 spills, and 128-thread blocks 5 a SM measured alike: NOTES.md), gather is as fast at 2, 3
# or 4; the transposed layout's gather spills at 4)
MIN_BLOCKS_PER_SM = {"compress": 2, "gather": 3, "sum": 2}
_KERNEL_BUDGET = {"taco_compress": "compress", "taco_gather": "gather", "taco_sum": "sum", "taco_sum_compress": "sum"}


@dataclass(frozen=True)
class Tuning:
    """How the kernels are launched and specialised, beyond the QuantConfig (every setting keeps the
    reference's bits; bench/taco_codec.py times them against each other in one process).

    persistent: the grid is at most the blocks that are resident at once (SMs x the kernel's
      occupancy), each warp looping over items with the next one's bytes in flight, so no block waits
      for a second wave and a message of 4-64 MiB is not a few short waves of one item per warp;
      False: up to `legacy_blocks_per_sm` blocks per SM (one item per warp below ~32 MiB).
    fetch16: how compress reads 16-bit input: "load" (into registers when it starts an item), "async"
      (the next item into shared memory by cp.async while it compresses the current one, as it always
      does for FP32 input), "auto" (async where the Hadamard transform is on, whose arithmetic the
      loads' latency can hide behind; load without it). NOTES.md has the measurements.
    transpose: G = 128 only: the cross-lane Hadamard stages and the RMS's cross-lane halvings run in
      registers after an exchange through shared memory (a lane then holds elements of all four of its
      group's lanes) instead of one warp shuffle per element and stage."""

    persistent: bool = True
    fetch16: str = "auto"
    transpose: bool = True
    legacy_blocks_per_sm: int = 8

    def __post_init__(self) -> None:
        if self.fetch16 not in FETCH16_MODES:
            raise ValueError(f"fetch16 must be one of {', '.join(FETCH16_MODES)}, got {self.fetch16!r}")

    def fetches_async(self, cfg: QuantConfig) -> bool:
        """Whether compress fetches 16-bit input under `cfg` by cp.async (the .cu's TACO_FETCH16)."""
        return self.fetch16 == "async" or (self.fetch16 == "auto" and bool(cfg.hadamard))


FETCH16_MODES = ("load", "async", "auto")


TUNING = Tuning()


def set_tuning(tuning: Tuning) -> Tuning:
    """Use `tuning` for later launches (recompiles on first use); returns the previous one."""
    global TUNING
    previous, TUNING = TUNING, tuning
    specialization.cache_clear()
    return previous


@dataclass(frozen=True)
class FusedBarrier:
    """A barrier across ranks that the next reading kernel (gather / sum / sum-compress) performs at
    its start, instead of a barrier kernel queued before it (the .cu's `Barrier`): it writes `epoch`
    to each address in `signal` (this rank's flag word in every rank's memory), then waits until each
    address in `wait` (every source's flag word here) holds `epoch` or more. Epochs only grow."""

    signal: tuple[int, ...]
    wait: tuple[int, ...]
    epoch: int

    def __post_init__(self) -> None:
        if len(self.signal) > MAX_SOURCES or len(self.wait) > MAX_SOURCES or self.epoch < 1:
            raise ValueError(f"a fused barrier signals and waits on at most {MAX_SOURCES} ranks with an epoch >= 1, "
                             f"got {len(self.signal)} / {len(self.wait)} and epoch {self.epoch}")


def barrier_arg(barrier: FusedBarrier | None) -> bytes:
    """The kernels' `Barrier` parameter: 8 signal addresses, 8 wait addresses, the epoch (0: none)."""
    if barrier is None:
        return _NO_BARRIER
    signal = [*barrier.signal, *[0] * (MAX_SOURCES - len(barrier.signal))]
    wait = [*barrier.wait, *[0] * (MAX_SOURCES - len(barrier.wait))]
    return _BARRIER.pack(*signal, *wait, barrier.epoch)


_BARRIER = struct.Struct(f"<{2 * MAX_SOURCES + 1}Q")
_NO_BARRIER = bytes(_BARRIER.size)
_SOURCES = struct.Struct(f"<{MAX_SOURCES}Q")  # the kernels' `Sources` parameter: one address per message


def sources_arg(addresses: Sequence[int]) -> bytes:
    """The kernels' `Sources` parameter: each message's (or raw part's) address, zeros after."""
    return _SOURCES.pack(*addresses, *[0] * (MAX_SOURCES - len(addresses)))


def source_addresses(arg: bytes, count: int) -> list[int]:
    """The first `count` addresses of a `Sources` parameter (`sources_arg`'s inverse)."""
    return list(_SOURCES.unpack(arg)[:count])


def _min_blocks(kernel: str, cfg: QuantConfig) -> int:
    """A kernel's register budget; adaptive decompression holds both transforms' values (spills
    above 2 blocks)."""
    return min(2, MIN_BLOCKS_PER_SM[kernel]) if cfg.hadamard == "adaptive" else MIN_BLOCKS_PER_SM[kernel]


def _fp32_literal(value: float) -> str:
    """`value` rounded to FP32 as quant.py's float32 arithmetic rounds it, as an exact C literal."""
    return struct.unpack("<f", struct.pack("<f", value))[0].hex() + "f"


@functools.lru_cache(maxsize=None)
def specialization(cfg: QuantConfig, io_dtype: torch.dtype, n_sum: int = 1) -> str:
    """The source for one specialization: the macros the .cu expects, then the .cu (cached: a launch
    looks its module up by this text; clear the cache after changing MIN_BLOCKS_PER_SM)."""
    if io_dtype not in DTYPE_CODE:
        raise TypeError(f"the CUDA kernels take float32, float16 or bfloat16 tensors, got {io_dtype}")
    if not 1 <= n_sum <= MAX_SOURCES:
        raise ValueError(f"the summing decompress adds 1..{MAX_SOURCES} messages, got {n_sum}")
    code = DTYPE_CODE[io_dtype]
    macros = {"TACO_G": cfg.group_size, "TACO_FMT": _FMT_CODE[cfg.fmt], "TACO_HADAMARD": _HADAMARD_CODE[cfg.hadamard],
              "TACO_DUAL": int(cfg.dual_scale), "TACO_CAST": DTYPE_CODE[cfg.transform_input_dtype],
              "TACO_IN": code, "TACO_OUT": code, "TACO_NSRC": n_sum,
              **{f"TACO_MIN_BLOCKS_{k.upper()}": _min_blocks(k, cfg) for k in MIN_BLOCKS_PER_SM},
              "TACO_FWHT_SCALE": _fp32_literal(1.0 / math.sqrt(cfg.group_size)),
              "TACO_FETCH16": int(TUNING.fetches_async(cfg)), "TACO_TRANSPOSE": int(TUNING.transpose)}
    return "".join(f"#define {k} {v}\n" for k, v in macros.items()) + SOURCE.read_text()


@functools.lru_cache(maxsize=None)
def _module(device_index: int, source: str):
    from commweave.runtime.compile import compile_cubin
    from commweave.runtime.launch import Module

    with torch.cuda.device(device_index):
        return Module(compile_cubin(source).path, "taco_kernels")


@dataclass(frozen=True)
class Launch:
    """One checked launch of a kernel, queued again by `__call__` with new values for the arguments
    named in `slots` (a per-call collective's addresses as ints; sources and barrier as the bytes
    `sources_arg` / `barrier_arg` make), on the current stream. The checks are the launching
    function's, made once: the caller keeps the rest of the layout (sizes, dtypes, alignment of
    every address it replaces, 16 bytes) as it was. Tensors are held as their addresses."""

    kernel: Any
    grid: int
    device_index: int
    args: tuple
    slots: Mapping[str, int]

    def __call__(self, **values: int | bytes) -> None:
        args = list(self.args)
        for name, value in values.items():
            args[self.slots[name]] = value
        with on_device(self.device_index):
            self.kernel(self.grid, THREADS, args)

    def value(self, name: str) -> int | bytes:
        """The argument `name` as launched first."""
        return self.args[self.slots[name]]


_recorder: contextvars.ContextVar[list[Launch] | None] = contextvars.ContextVar("taco_cuda_recorder", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """Every launch of this module's kernels queued inside (this thread/context), in order: what a
    collective replays for later calls of the same layout (`device.DeviceCollectives`)."""
    launches: list[Launch] = []
    token = _recorder.set(launches)
    try:
        yield launches
    finally:
        _recorder.reset(token)


def _device_index(device: torch.device) -> int:
    if device.type != "cuda":
        raise ValueError(f"the CUDA kernels need CUDA tensors, got {device} (use impl='reference' or the Triton kernels)")
    return device.index if device.index is not None else torch.cuda.current_device()


def _launch(device: torch.device, source: str, name: str, warp_items: int, args: list, slots: Mapping[str, int],
            max_blocks: int | None = None) -> None:
    """Launch kernel `name` of `source`'s cubin on `device`'s current stream, one warp per item (a
    grid of at most `max_blocks` blocks when given: the warps loop over the rest)."""
    index = _device_index(device)
    kernel = _module(index, source).kernel(name)
    grid = _grid(index, warp_items, _resident_blocks(kernel, _min_blocks_of(source, name)))
    launch = Launch(kernel, grid if max_blocks is None else min(grid, max_blocks), index,
                    tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args), slots)
    launch()
    recorded = _recorder.get()
    if recorded is not None:
        recorded.append(launch)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _min_blocks_of(source: str, name: str) -> int:
    """The register budget `source` was specialised with for kernel `name` (its launch bound)."""
    macro = f"#define TACO_MIN_BLOCKS_{_KERNEL_BUDGET[name].upper()} "
    start = source.index(macro) + len(macro)
    return int(source[start:source.index("\n", start)])


_resident: dict[Any, int] = {}


def _resident_blocks(kernel: Any, launch_bound: int) -> int:
    """Blocks of THREADS of `kernel` resident at once on an SM (the driver's occupancy for its
    registers and shared memory; the launch bound where the kernel is not a driver function)."""
    function = getattr(kernel, "function", None)
    if function is None:
        return launch_bound
    if kernel not in _resident:
        from commweave.runtime.launch import _driver

        err, blocks = _driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(function, THREADS, 0)
        _resident[kernel] = int(blocks) if int(err) == 0 and int(blocks) > 0 else launch_bound
    return _resident[kernel]


def _grid(device_index: int, warp_items: int, resident: int) -> int:
    """Blocks for `warp_items` warps' worth of items: a persistent grid (at most the blocks resident at
    once: warps loop over the rest) under TUNING.persistent, else capped at legacy_blocks_per_sm."""
    blocks = -(-warp_items // (THREADS // 32))
    per_sm = resident if TUNING.persistent else TUNING.legacy_blocks_per_sm
    return max(1, min(blocks, _sm_count(device_index) * per_sm))


def _items(numel: int) -> int:
    """Work items (warps) of one message: 1024 elements each (the .cu's ITEM)."""
    return -(-numel // 1024)


def _apart_rows(t: torch.Tensor, rows: int) -> bool:
    """t is a [rows, n] view whose rows are each contiguous but not back to back (a column slice of
    a wider tensor: one piece of every rank's part in a pipelined collective)."""
    return t.dim() == 2 and t.shape[0] == rows and t.stride(1) == 1 and not t.is_contiguous()


def _aligned(ptr: int, stride_bytes: int) -> bool:
    return ptr % 16 == 0 and stride_bytes % 16 == 0


def compress_into(x: torch.Tensor, cfg: QuantConfig, buf: torch.Tensor, segments: int = 1,
                  skip: int | None = None, max_blocks: int | None = None,
                  own_out: torch.Tensor | None = None) -> torch.Tensor:
    """Compress `x` into `buf` (16-byte aligned) in `quant.pack`'s layout; with `segments` > 1, x
    (split into that many equal chunks along dim 0) into as many packed messages, chunk q at
    q * cfg.packed_stride(chunk) (what a reduce-scatter sends rank q), all but chunk `skip` (its
    bytes are left as they are). x may also be a [segments, chunk] view whose rows are contiguous
    but apart (a column slice of every rank's chunk: a pipelined reduce-scatter's piece); it is read
    in place. One launch, of at most `max_blocks` blocks of 256 threads when given (what a caller
    lends the compression beside other kernels, e.g. a pipelined collective's reads). `own_out` (one
    message only): also write decompress(the message) there, from the quantized values still in
    registers (an all-gather's own part; the same bits `gather_into` would write). Returns buf."""
    if x.dtype not in DTYPE_CODE:
        raise TypeError(f"the CUDA kernels compress float32, float16 or bfloat16 tensors, got {x.dtype}")
    if x.dim() == 0 or segments < 1 or x.shape[0] % segments:
        raise ValueError(f"cannot split shape {tuple(x.shape)} into {segments} equal chunks along dim 0")
    if skip is not None and not 0 <= skip < segments:
        raise ValueError(f"skip must be a chunk index in 0..{segments - 1} or None, got {skip}")
    if max_blocks is not None and max_blocks < 1:
        raise ValueError(f"max_blocks must be at least 1 or None, got {max_blocks}")
    rows = _apart_rows(x, segments)
    if not rows:
        x = x.contiguous()
    chunk = x.numel() // segments
    x_stride = x.stride(0) if rows else chunk
    wire = cfg.wire_bytes(chunk)  # raises for pad=False and a ragged chunk
    stride = cfg.packed_stride(chunk) if segments > 1 else wire
    size = segments * stride
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous() or buf.numel() != size:
        raise ValueError(f"buf must be a contiguous 1-D uint8 tensor of {size} bytes for {segments} "
                         f"message(s) of {chunk} elements under {cfg}, got {buf.dtype} {tuple(buf.shape)}")
    if buf.device != x.device:
        raise ValueError(f"x is on {x.device} but buf on {buf.device}")
    if buf.data_ptr() % 16:
        raise ValueError("buf must start at a 16-byte aligned address (the kernels store 16 bytes at a time)")
    if own_out is not None and (segments != 1 or own_out.dtype != x.dtype or own_out.numel() != chunk
                                or not own_out.is_contiguous() or own_out.device != x.device):
        raise ValueError(f"own_out must be a contiguous {x.dtype} tensor of {chunk} elements on {x.device} and x one "
                         f"message, got {own_out.dtype} {tuple(own_out.shape)} on {own_out.device} with {segments} "
                         f"segments")
    if chunk == 0:
        return buf
    vec = _aligned(x.data_ptr(), chunk * x.element_size()) and _aligned(0, x_stride * x.element_size())
    own_vec = own_out is not None and _aligned(own_out.data_ptr(), 0)
    _launch(x.device, specialization(cfg, x.dtype), "taco_compress", segments * _items(chunk),
            [x, chunk, x_stride, segments, buf, stride, int(vec), -1 if skip is None else skip,
             0 if own_out is None else own_out.data_ptr(), int(own_vec)], {"x": 0, "own_out": 8}, max_blocks)
    return buf


def compress(x: torch.Tensor, cfg: QuantConfig | None = None) -> Compressed:
    """`quant.compress` in one kernel; the result's tensors are views of one packed buffer."""
    cfg = cfg or QuantConfig()
    buf = torch.empty(cfg.wire_bytes(x.numel()), dtype=torch.uint8, device=x.device)
    compress_into(x, cfg, buf)
    return packed_view(buf, x.shape, x.dtype, cfg)


def _packed_address(c: Compressed) -> int:
    """The packed message's first byte; refuses a Compressed whose tensors are not `pack`'s layout
    in one buffer (the kernels find the scales from the payload's address). Checked once per
    message object (`Compressed.packed_check`) while its tensors stay the same."""
    done = c.packed_check
    if done is not None and done[0] is c.payload and done[1] is c.scale and done[2] is c.pre_scale and done[3] is c.config:
        return done[4]
    cfg = c.config
    groups = c.num_groups
    if c.payload.dtype != cfg.fp8_dtype or tuple(c.payload.shape) != (groups, cfg.group_size):
        raise ValueError(f"payload {c.payload.dtype} {tuple(c.payload.shape)} does not match {cfg}")
    if groups != cfg.num_groups(c.numel):
        raise ValueError(f"{groups} groups do not hold {c.numel} elements at G={cfg.group_size}")
    if (c.pre_scale is not None) != cfg.dual_scale:
        raise ValueError(f"pre_scale is {'present' if c.pre_scale is not None else 'missing'} but dual_scale={cfg.dual_scale}")
    base = c.payload.data_ptr()
    n_payload = groups * cfg.group_size
    packed = (c.payload.is_contiguous() and c.scale.is_contiguous() and c.scale.data_ptr() == base + n_payload
              and (c.pre_scale is None or (c.pre_scale.is_contiguous() and c.pre_scale.data_ptr() == base + n_payload + 4 * groups)))
    if not packed:
        raise ValueError("the CUDA kernels read packed messages (payload, scales, pre-scales back to back, as "
                         "`quant.pack` / `compress_into` write them): use `quant.packed_view` of the buffer")
    if base % 16:
        raise ValueError(f"a packed message must start at a 16-byte aligned address (the kernels load 16 bytes at a "
                         f"time), this one is at {base % 16} past one")
    c.packed_check = (c.payload, c.scale, c.pre_scale, c.config, base)
    return base


def _sources(parts: Sequence[Compressed | torch.Tensor], what: str,
             dtype: torch.dtype) -> tuple[QuantConfig, int, bytes, int]:
    """Checks the parts against the result's dtype: their config, elements per message, addresses,
    and the index of the one raw tensor part (-1: none)."""
    if not 1 <= len(parts) <= MAX_SOURCES:
        raise ValueError(f"{what} takes 1..{MAX_SOURCES} messages, got {len(parts)}")
    cs = [p for p in parts if isinstance(p, Compressed)]
    own = [i for i, p in enumerate(parts) if not isinstance(p, Compressed)]
    if not cs or len(own) > 1:
        raise ValueError(f"{what} takes packed messages and at most one raw tensor (a rank's own chunk), got "
                         f"{len(cs)} messages and {len(own)} tensors")
    cfg, numel = cs[0].config, cs[0].numel
    for c in cs[1:]:
        if c.config != cfg or c.numel != numel:
            raise ValueError(f"{what}: every message must have the same config and size, got {c.config}/{c.numel} "
                             f"and {cfg}/{numel}")
    addresses = [p.data_ptr() if i in own else _packed_address(p) for i, p in enumerate(parts)]
    if dtype not in DTYPE_CODE:
        raise TypeError(f"the CUDA kernels decompress to float32, float16 or bfloat16, got {dtype}")
    for i in own:
        t = parts[i]
        if t.dtype != dtype or t.numel() != numel or not t.is_contiguous():
            raise ValueError(f"{what}: the raw part must be a contiguous {dtype} tensor of {numel} elements, got "
                             f"{t.dtype} {tuple(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}")
    return cfg, numel, sources_arg(addresses), own[0] if own else -1


def _check_result(parts: Sequence[Compressed | torch.Tensor], result: torch.Tensor, numel: int, what: str) -> None:
    """The result tensor: contiguous, `numel` elements, on the CUDA device that holds the parts."""
    if result.numel() != numel or not result.is_contiguous():
        raise ValueError(f"{what}: out must be a contiguous tensor of {numel} elements, got {tuple(result.shape)}"
                         f"{'' if result.is_contiguous() else ' (not contiguous)'}")
    devices = {p.payload.device if isinstance(p, Compressed) else p.device for p in parts}
    if result.device.type != "cuda" or devices != {result.device}:
        raise ValueError(f"{what}: the result must be a CUDA tensor on the messages' device, got {result.device}, "
                         f"messages on {sorted(map(str, devices))}")


def gather_into(cs: Sequence[Compressed], out: torch.Tensor, barrier: FusedBarrier | None = None,
                skip: int | None = None) -> torch.Tensor:
    """out[p] = decompress(cs[p]) for every message but `skip` (out: len(cs) * numel elements, any
    shape; or a [len(cs), numel] view whose rows are contiguous but apart, e.g. one piece of every
    rank's part of an all-gather; out[skip] is left as it is), in one launch whose warps interleave
    the messages (every peer's link busy), after `barrier` when given (the kernel performs it even
    when there is nothing to read)."""
    if any(not isinstance(c, Compressed) for c in cs):
        raise ValueError("gather_into takes packed messages only")
    if skip is not None and not 0 <= skip < len(cs):
        raise ValueError(f"skip must be a message index in 0..{len(cs) - 1} or None, got {skip}")
    cfg, numel, ptrs, _ = _sources(cs, "gather_into", out.dtype)
    rows = _apart_rows(out, len(cs))
    if not rows:
        _check_result(cs, out, len(cs) * numel, "gather_into")
    else:
        _check_result(cs, out[0], numel, "gather_into")
    out_stride = out.stride(0) if rows else numel
    read = len(cs) - (skip is not None)
    if (numel and read) or barrier is not None:
        vec = _aligned(out.data_ptr(), out_stride * out.element_size())
        _launch(out.device, specialization(cfg, out.dtype), "taco_gather", read * _items(numel),
                [ptrs, len(cs), numel, out, out_stride, int(vec), -1 if skip is None else skip, barrier_arg(barrier)],
                {"sources": 0, "out": 3, "barrier": 7})
    return out


def _only_raw(parts: Sequence[Compressed | torch.Tensor], barrier: FusedBarrier | None, what: str) -> bool:
    """One raw tensor and no message: a one-rank sum (a barrier with peers would make no sense)."""
    if len(parts) != 1 or isinstance(parts[0], Compressed):
        return False
    if barrier is not None and (barrier.signal or barrier.wait):
        raise ValueError(f"{what}: a barrier with peers for a sum of this rank's own part alone")
    return True


def sum_into(parts: Sequence[Compressed | torch.Tensor], out: torch.Tensor,
             barrier: FusedBarrier | None = None) -> torch.Tensor:
    """out = (sum over the parts of their FP32 decompressions, in order) cast to out's dtype: the
    reference's `decompress(parts[0]) + decompress(parts[1]) + ...` then `.to(dtype)`, in one launch
    (after `barrier` when given). One part may be a raw tensor of out's dtype (a reduce-scatter's own
    chunk), added exactly; alone (one rank), it is the sum."""
    if _only_raw(parts, barrier, "sum_into"):
        return out.copy_(parts[0].view(out.shape))
    cfg, numel, ptrs, own = _sources(parts, "sum_into", out.dtype)
    _check_result(parts, out, numel, "sum_into")
    if numel or barrier is not None:
        vec = _aligned(out.data_ptr(), 0) and (own < 0 or _aligned(parts[own].data_ptr(), 0))
        _launch(out.device, specialization(cfg, out.dtype, len(parts)), "taco_sum", _items(numel),
                [ptrs, numel, out, int(vec), own, barrier_arg(barrier)], {"sources": 0, "out": 2, "barrier": 5})
    return out


def sum_compress_into(parts: Sequence[Compressed | torch.Tensor], dtype: torch.dtype, cfg: QuantConfig,
                      buf: torch.Tensor, barrier: FusedBarrier | None = None,
                      own_out: torch.Tensor | None = None) -> torch.Tensor:
    """buf = pack(compress(sum_into(parts) in `dtype`, cfg)) in one launch (after `barrier` when
    given): two-shot all-reduce's requantization of its reduced chunk, with no round trip of that
    chunk through memory; with `own_out` (a contiguous `dtype` tensor of the chunk's size), also
    decompress(that message) written there (this rank's part of two-shot's all-gather). `cfg` must
    be the messages' own (the kernel is specialised for one config). A raw part alone (one rank) is
    the sum: it is compressed as it is."""
    if _only_raw(parts, barrier, "sum_compress_into"):
        return compress_into(parts[0].to(dtype).reshape(-1), cfg, buf, own_out=own_out)
    first = next((p for p in parts if isinstance(p, Compressed)), None)
    if first is not None and first.config != cfg:
        raise ValueError(f"sum_compress_into requantizes with the messages' config {first.config}, got {cfg}")
    _, numel, ptrs, own = _sources(parts, "sum_compress_into", dtype)
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError(f"buf must be a 1-D uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
    if own_out is not None and (own_out.dtype != dtype or own_out.numel() != numel or not own_out.is_contiguous()
                                or own_out.device != buf.device):
        raise ValueError(f"own_out must be a contiguous {dtype} tensor of {numel} elements on {buf.device}, got "
                         f"{own_out.dtype} {tuple(own_out.shape)} on {own_out.device}")
    _check_result(parts, buf, cfg.wire_bytes(numel), "sum_compress_into")
    if buf.data_ptr() % 16:
        raise ValueError("buf must start at a 16-byte aligned address (the kernels store 16 bytes at a time)")
    if numel or barrier is not None:
        vec = own < 0 or _aligned(parts[own].data_ptr(), 0)
        own_vec = own_out is not None and _aligned(own_out.data_ptr(), 0)
        _launch(buf.device, specialization(cfg, dtype, len(parts)), "taco_sum_compress", _items(numel),
                [ptrs, numel, buf, int(vec), own, 0 if own_out is None else own_out.data_ptr(), int(own_vec),
                 barrier_arg(barrier)], {"sources": 0, "own_out": 5, "barrier": 7})
    return buf


def decompress(c: Compressed, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`quant.decompress` in one kernel (a Compressed whose tensors are not one packed buffer, e.g.
    the reference's, is packed first: one copy)."""
    try:
        _packed_address(c)
    except ValueError:
        c = packed_view(pack(c), c.shape, c.dtype, c.config)
    out = torch.empty(c.shape, dtype=dtype or c.dtype, device=c.payload.device)
    gather_into([c], out)
    return out
