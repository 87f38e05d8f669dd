"""Device-initiated compressed collectives: the "device" backend of `taco.collectives`.

On CUDA, within one node: each rank compresses into its own symmetric buffer (one launch writes
`quant.pack`'s layout into a uint8 window, every chunk of a reduce-scatter at once), an LSA barrier
(`ctx.device_barrier()`) makes the bytes visible, then one kernel reads every rank's payload and
scales straight from their windows (peer addresses: loads over NVLink) and decompresses them into
their places (all-gather) or sums them in FP32 in rank order and casts once (reduce-scatter,
all-reduce). No host round trip, no staging copy: everything is queued on the caller's stream.

Semantics are the reference backend's (`collectives.ReferenceBackend`), step for step: the same
chunks compressed separately, the same FP32 sums in rank order 0..W-1 (first term decompressed,
the rest accumulated), the same cast back to the input dtype, two-shot's same padding to whole
groups per rank and requantization of the reduced chunk in the input dtype. With the fused kernels,
which equal the reference bit for bit, the results are therefore bit-identical to the reference
backend's (tolerance: none; the GPU test asserts equality), and identical on every rank.

Structure (so the algorithm is testable without GPUs):
  * `Transport`: where each rank's packed bytes live and how a peer's are read, plus the barrier.
    `WindowTransport` is the real one (symmetric windows of a RankContext); the CPU tests use an
    in-process fake that simulates W ranks as threads.
  * `Codec`: compress (chunks) into a buffer; decompress a set of messages into their places, or
    their FP32 sum. `CudaCodec` (`taco/cuda.py`: one launch per step, the default on CUDA),
    `TritonCodec` (`kernels.py`: one launch per message), `ReferenceCodec` (quant.py, any device:
    the CPU tests).
  * `DeviceCollectives(transport, codec)`: the algorithms.

Reuse of buffers, and why the barrier is lazy rather than a second barrier per call: a rank may
overwrite its buffer only after every peer has finished reading the previous contents, i.e. after a
barrier that all ranks passed behind those reads. Instead of a trailing barrier in every call, each
buffer remembers the barrier count at which it was last read, and a write inserts a barrier first
only if none has happened since. Two-shot's second phase and any later collective's barrier thus
cover the previous reads for free (two-shot needs exactly its two barriers). Single-phase ops
(all-gather, reduce-scatter, one-shot) called back to back would need a barrier before each write,
i.e. two per call; `double_buffer=True` alternates two buffers by call parity per (op, shape, dtype,
cfg), so the other call's barrier covers the reads: one barrier per call, at twice the symmetric
memory. `DeviceBackend` double-buffers by default: on 2 H200s the second barrier cost ~4 µs a call
(all-gather 1.46x -> 1.63x NCCL at 16 MiB, reduce-scatter 1.29x -> 1.45x;
taco-bandwidth-2gpu-20261201T094714Z / T095910Z), and two compressed buffers together are about
one BF16 message. The rule is the same for both; the CPU tests check it with a hazard tracker.

Fused barriers (`DeviceBackend(fuse_barriers=True)`, CUDA codec; off until measured on several
GPUs): the barrier between a call's writes and its reads is performed by the reading kernel itself
(`cuda.FusedBarrier`: every block first writes the barrier's number into this rank's flag word in
each peer's memory, then waits for each peer's word here), instead of a barrier kernel queued before
it: on 2 H200s that kernel took ~3.5 µs plus a ~1 µs launch gap of a 16 MiB all-gather's ~34 µs
(bench/profile_taco.py's timeline). Every rank signals after its earlier reads and waits for every
rank, so it counts as a barrier for the rewrite rule. Not under CUDA graph capture (the number is a
host value a replay would repeat): a barrier kernel then.

Pipelining (`pieces` > 1; default 1 until measured on several GPUs): a message is cut into up to
`pieces` equal pieces (whole 1024-element work items, at least MIN_PIECE elements each; sizes that
do not split so run unpipelined), each its own packed message. Compression runs on a side stream
piece by piece, each piece published to its readers as soon as it is written (a flag in every
reader's memory set to the call's epoch, by a stream memory write after the compression); the
caller's stream waits for piece k's flags and reads it while piece k + 1 is compressed. No barrier
between writing and reading; the rewrite rule above is unchanged (so a pipelined call has at most
the one barrier before rewriting). Groups never straddle pieces, so the bytes are the reference's.

Replayed launches (CUDA codec, unpipelined calls): a call's Python, not its kernels, bounds a
model whose step is host-bound, and most of it (views of the output, the codec's argument checks)
depends only on the call's layout. So the first call per (op, shape, dtype, cfg, buffer parity,
16-byte alignment of the input and output) runs the checked path and records its kernel launches
(`cuda.recording`); later calls queue the same launches with their own addresses (input, output,
own parts, the barrier) between the same barriers. The launches are byte for byte the checked
path's (the CPU tests compare them).

CUDA graphs: a captured call is replayed any number of times, later, with no host bookkeeping, so
the lazy rule above cannot know what ran since. Under capture every write is preceded by its
rewrite barrier, and a buffer a captured call read gets one before every later write too (eager
or captured); the transport does not order the capture stream after the previous call's stream
(waiting on uncaptured work is illegal in a capture; torch.cuda.graph synchronizes the device
before it captures); fused barriers become barrier kernels (their epoch is a host value). Pipelined
calls are refused under capture (their flags' epoch is a host value too).

Collective: every call, and the first call per (op, shape, dtype, cfg) allocates symmetric buffers
(`ctx.symmetric`, collective): all ranks make the same calls in the same order with the same
shapes, dtypes and configs, as with any torch.distributed collective. Buffers are kept per
(op, shape, dtype, cfg[, parity]) until `close()` (or the context's end_candidate / close).
Calls on different CUDA streams are ordered by the transport (the later stream waits on the
earlier one): the buffers are not torch allocations, so torch would not order them.

Inputs: CUDA tensors on the context's device, FP32/FP16/BF16; reduce-scatter needs dim 0 divisible
by the world size; the group must be the context's (the default process group). Anything else is a
ValueError / TypeError saying which.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any, ContextManager, Hashable, Iterator, Protocol

import torch
import torch.distributed as dist

from commweave.runtime.launch import current_stream_handle, on_device
from commweave.taco.collectives import AllReduceAlgo, register_backend
from commweave.taco.cuda import FusedBarrier, Launch, barrier_arg, recording, source_addresses, sources_arg
from commweave.taco.quant import Compressed, QuantConfig, compress, decompress, pack, packed_view

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_PIECES = 8  # per message; two-shot uses two sets of slots
PIECE_ALIGN = 1024  # elements: a CUDA work item, a multiple of every group size
MIN_PIECE = 1 << 20  # elements: below this a piece's launches cost more than the overlap saves
ANY_TIME = -1  # _read_at of a buffer a captured call read: a graph replay may read it at any time
FLAG_SLOTS = 2 * MAX_PIECES  # per source rank: pipelined pieces
BARRIER_SLOT = FLAG_SLOTS  # per source rank: the fused barriers' flag word


class Transport(Protocol):
    """Where packed bytes live: one buffer per rank per key, peers' readable, and a barrier."""

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

    # pipelined calls (pieces > 1): per-piece flags instead of a barrier between writes and reads
    def side(self) -> ContextManager[None]:
        """Work issued inside runs beside the caller's stream (after what the caller queued so far)."""
        ...

    def join(self) -> None:
        """The caller's stream waits for the work issued inside `side()`."""
        ...

    def publish(self, slot: int, epoch: int, ranks: Sequence[int]) -> None:
        """After the work issued before it: tell each rank in `ranks` that this rank's piece `slot`
        of call `epoch` is written (its flag [this rank][slot] in their memory becomes `epoch`)."""
        ...

    def wait(self, slot: int, epoch: int, ranks: Sequence[int]) -> None:
        """Work issued after it waits until every rank in `ranks` published piece `slot` of `epoch`
        (or a later call) to this rank."""
        ...


class Codec(Protocol):
    fuses_barriers: bool  # its reading calls take a FusedBarrier (else the collectives queue barrier())

    def compress_into(self, x: torch.Tensor, cfg: QuantConfig, buf: torch.Tensor, segments: int = 1,
                      skip: int | None = None, own_out: torch.Tensor | None = None) -> None:
        """x split into `segments` equal chunks along dim 0, chunk q packed at q * packed_stride(chunk)
        (one message: the whole buffer); chunk `skip` is not compressed (its segment is left as is).
        x may be a [segments, chunk] view with contiguous rows apart (a pipelined piece). `own_out`
        (one message): also decompress(the message) written there (an all-gather's own part)."""
        ...

    def gather_into(self, cs: list[Compressed], out: torch.Tensor, barrier: FusedBarrier | None = None,
                    skip: int | None = None) -> None:
        """out[p] = decompress(cs[p]) for p != skip (out: (len(cs), *shape), contiguous; or
        [len(cs), numel] with contiguous rows apart: a pipelined piece of every rank's part).
        `barrier` (only if `fuses_barriers`): performed first, by the same launch."""
        ...

    def sum_into(self, parts: list[Compressed | torch.Tensor], out: torch.Tensor,
                 barrier: FusedBarrier | None = None) -> None:
        """out = (FP32 term 0 + term 1 + ...) cast to out's dtype; a term is decompress(part), or the
        part itself (exact) where it is a tensor (a rank's own chunk). One tensor part at most."""
        ...

    def sum_compress_into(self, parts: list[Compressed | torch.Tensor], dtype: torch.dtype, cfg: QuantConfig,
                          buf: torch.Tensor, barrier: FusedBarrier | None = None,
                          own_out: torch.Tensor | None = None) -> None:
        """buf = pack(compress(the sum_into result in `dtype`, cfg)): two-shot's requantization;
        `own_out`: also decompress(that message) written there (this rank's part of phase 2)."""
        ...


def _unfused(barrier: FusedBarrier | None) -> None:
    if barrier is not None:
        raise ValueError("this codec does not fuse barriers (fuses_barriers is False): queue the transport's barrier()")


class PerMessageCodec:
    """A codec from single-message compress/decompress/accumulate: the collectives' steps one
    launch per message, summed through an FP32 accumulator in memory."""

    fuses_barriers = False

    def compress_one(self, x: torch.Tensor, cfg: QuantConfig, buf: torch.Tensor) -> None:
        raise NotImplementedError

    def decompress_one(self, c: Compressed, out: torch.Tensor) -> None:
        raise NotImplementedError

    def accumulate_one(self, c: Compressed, acc: torch.Tensor) -> None:
        raise NotImplementedError

    def compress_into(self, x: torch.Tensor, cfg: QuantConfig, buf: torch.Tensor, segments: int = 1,
                      skip: int | None = None, own_out: torch.Tensor | None = None) -> None:
        chunks = x.chunk(segments, dim=0)
        wire = cfg.wire_bytes(chunks[0].numel())
        stride = cfg.packed_stride(chunks[0].numel()) if segments > 1 else wire
        for q, chunk in enumerate(chunks):
            if q != skip:
                self.compress_one(chunk, cfg, buf[q * stride:q * stride + wire])
        if own_out is not None:
            if segments != 1:
                raise ValueError(f"own_out takes one message, not {segments} segments")
            self.decompress_one(packed_view(buf[:wire], (x.numel(),), x.dtype, cfg), own_out)

    def gather_into(self, cs: list[Compressed], out: torch.Tensor, barrier: FusedBarrier | None = None,
                    skip: int | None = None) -> None:
        _unfused(barrier)
        for p, c in enumerate(cs):
            if p != skip:
                self.decompress_one(c, out[p])

    def sum_into(self, parts: list[Compressed | torch.Tensor], out: torch.Tensor,
                 barrier: FusedBarrier | None = None) -> None:
        _unfused(barrier)
        acc = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        for i, part in enumerate(parts):
            if isinstance(part, torch.Tensor):  # own chunk, exact
                if i == 0:
                    acc.copy_(part.view(acc.shape))
                else:
                    acc.add_(part.view(acc.shape))
            elif i == 0:
                self.decompress_one(part, acc)  # not accumulated onto zeros: keeps -0.0 as the reference
            else:
                self.accumulate_one(part, acc)
        out.copy_(acc)

    def sum_compress_into(self, parts: list[Compressed | torch.Tensor], dtype: torch.dtype, cfg: QuantConfig,
                          buf: torch.Tensor, barrier: FusedBarrier | None = None,
                          own_out: torch.Tensor | None = None) -> None:
        _unfused(barrier)
        shape = parts[0].shape  # a message's, or the own part's (alone on one rank)
        reduced = torch.empty(shape, dtype=dtype, device=buf.device)
        self.sum_into(parts, reduced)
        self.compress_one(reduced, cfg, buf)
        if own_out is not None:
            self.decompress_one(packed_view(buf, reduced.shape, dtype, cfg), own_out)


class ReferenceCodec(PerMessageCodec):
    """quant.py's compress/decompress (torch; any device): the reference bits, for CPU tests."""

    def compress_one(self, x: torch.Tensor, cfg: QuantConfig, buf: torch.Tensor) -> None:
        buf.copy_(pack(compress(x, cfg)))

    def decompress_one(self, c: Compressed, out: torch.Tensor) -> None:
        out.copy_(decompress(c, out.dtype).view(out.shape))

    def accumulate_one(self, c: Compressed, acc: torch.Tensor) -> None:
        acc.add_(decompress(c, torch.float32).view(acc.shape))  # = collectives._sum_fp32's `total + d`


class TritonCodec(PerMessageCodec):
    """The fused Triton kernels (bit for bit the reference); imported on first use (needs triton)."""

    def __init__(self) -> None:
        from commweave.taco import kernels

        self._k = kernels

    def compress_one(self, x: torch.Tensor, cfg: QuantConfig, buf: torch.Tensor) -> None:
        self._k.compress_into(x, cfg, buf)

    def decompress_one(self, c: Compressed, out: torch.Tensor) -> None:
        self._k.decompress_into(c, out)

    def accumulate_one(self, c: Compressed, acc: torch.Tensor) -> None:
        self._k.decompress_accumulate(c, acc)


class CudaCodec:
    """The CUDA kernels (`taco/cuda.py`, bit for bit the reference): one launch compresses every
    chunk, one reads every rank's message (gathering, or summing in FP32 and casting once), with
    `fuse_barriers` performing the barrier before it itself (else the collectives queue one).
    `compress_blocks`: the most thread blocks a compression takes (None: as many as it fills), so a
    pipelined collective's compression leaves SMs to the reads beside it."""

    def __init__(self, compress_blocks: int | None = None, fuse_barriers: bool = False) -> None:
        from commweave.taco import cuda

        if compress_blocks is not None and compress_blocks < 1:
            raise ValueError(f"compress_blocks must be at least 1 or None, got {compress_blocks}")
        self._k = cuda
        self.compress_blocks = compress_blocks
        self.fuses_barriers = fuse_barriers

    def compress_into(self, x: torch.Tensor, cfg: QuantConfig, buf: torch.Tensor, segments: int = 1,
                      skip: int | None = None, own_out: torch.Tensor | None = None) -> None:
        self._k.compress_into(x, cfg, buf, segments, skip, self.compress_blocks, own_out)

    def gather_into(self, cs: list[Compressed], out: torch.Tensor, barrier: FusedBarrier | None = None,
                    skip: int | None = None) -> None:
        self._k.gather_into(cs, out, barrier, skip)

    def sum_into(self, parts: list[Compressed | torch.Tensor], out: torch.Tensor,
                 barrier: FusedBarrier | None = None) -> None:
        self._k.sum_into(parts, out, barrier)

    def sum_compress_into(self, parts: list[Compressed | torch.Tensor], dtype: torch.dtype, cfg: QuantConfig,
                          buf: torch.Tensor, barrier: FusedBarrier | None = None,
                          own_out: torch.Tensor | None = None) -> None:
        self._k.sum_compress_into(parts, dtype, cfg, buf, barrier, own_out)


class DeviceCollectives:
    """The compressed collectives over a Transport and a Codec (see the module docstring)."""

    def __init__(self, transport: Transport, codec: Codec, double_buffer: bool = False, pieces: int = 1):
        if not 1 <= pieces <= MAX_PIECES:
            raise ValueError(f"pieces must be in 1..{MAX_PIECES}, got {pieces}")
        self.t = transport
        self.codec = codec
        self.double_buffer = double_buffer
        self.pieces = pieces
        self.barriers = 0  # barriers issued so far (identical on every rank: calls are collective)
        self.epoch = 0  # pipelined calls so far: the flags' value for the current one
        self._read_at: dict[Hashable, int] = {}  # buffer key -> barrier count when peers last read it
        self._calls: dict[Hashable, int] = defaultdict(int)
        # every rank's packed views of a buffer's bytes, made once: the buffers live until close(),
        # and making W views per call was ~1/3 of a call's host time
        self._views: dict[tuple, list[Compressed]] = {}
        # replay key -> the launches an unpipelined call of that layout queued (None: not replayable)
        self._replays: dict[Hashable, tuple[Launch, ...] | None] = {}

    def plan(self, numel: int) -> tuple[int, int]:
        """(pieces, elements a piece) for a message of `numel` elements: the most pieces up to
        `self.pieces` that split it into equal whole work items (PIECE_ALIGN elements, so groups
        never straddle pieces and each piece compresses to exactly the reference's bytes) of at
        least MIN_PIECE elements; (1, numel) when none does (no pipelining)."""
        for n in range(self.pieces, 1, -1):
            if numel % (n * PIECE_ALIGN) == 0 and numel // n >= MIN_PIECE:
                return n, numel // n
        return 1, numel

    def _pipeline(self, n: int, produce: Callable[[int], None], consume: Callable[[int], None],
                  to_ranks: Sequence[int], from_ranks: Sequence[int]) -> None:
        """Piece k: `produce(k)` beside the caller's stream, then published to `to_ranks`; on the
        caller's stream, wait for piece k of `from_ranks`, then `consume(k)`. Consuming piece k
        (NVLink reads) overlaps producing piece k + 1 (compression)."""
        if self.t.capturing():
            raise ValueError("a pipelined collective (pieces > 1) cannot be captured in a CUDA graph: its flags "
                             "carry the call's number, a host value every replay would repeat; use pieces=1")
        with self.t.side():
            for k in range(n):
                produce(k)
                self.t.publish(k, self.epoch, to_ranks)
        for k in range(n):
            self.t.wait(k, self.epoch, from_ranks)
            consume(k)
        self.t.join()

    # -- buffers and ordering ------------------------------------------------------------------
    def _barrier(self) -> None:
        self.t.barrier()
        self.barriers += 1

    def _read_barrier(self) -> FusedBarrier | None:
        """The barrier between this call's writes and its reads: handed to the reading launch where
        the codec and the transport can fuse it (returned), else queued now (None). Either kind
        counts for the rewrite rule: every rank signals it after its earlier reads, and waits for
        every rank's signal before reading (or writing again)."""
        self.barriers += 1
        fused = self.t.fused_barrier(self.barriers) if self.codec.fuses_barriers else None
        if fused is None:
            self.t.barrier()
        return fused

    def _buffer(self, op: str, shape: tuple[int, ...], dtype: torch.dtype, cfg: QuantConfig,
                nbytes: int) -> tuple[Hashable, torch.Tensor]:
        """This call's buffer, and a barrier first if peers may still read its last contents (under
        capture always: a replay's reads of it have no host record)."""
        base = (op, shape, dtype, cfg)
        parity = self._parity(base)
        self._calls[base] += 1
        key = (*base, parity)
        buf = self.t.buffer(key, nbytes)
        if self._read_at.get(key) in (self.barriers, ANY_TIME) or self.t.capturing():
            self._barrier()
        return key, buf

    def _read(self, key: Hashable) -> None:
        """Peers have read `key`'s buffer up to now: its next write needs a barrier unless one comes
        first; once a captured call has read it, always (a replay may read it again at any time,
        after any host-counted barrier; see the module docstring)."""
        if self.t.capturing() or self._read_at.get(key) == ANY_TIME:
            self._read_at[key] = ANY_TIME
        else:
            self._read_at[key] = self.barriers

    def _parity(self, base: tuple) -> int:
        """Which of a double-buffered (op, shape, dtype, cfg)'s two buffers its next call takes."""
        return self._calls[base] % 2 if self.double_buffer else 0

    def _replay_key(self, op: str, shape: tuple[int, ...], dtype: torch.dtype, cfg: QuantConfig, numel: int,
                    *tensors: torch.Tensor) -> Hashable | None:
        """The key of the launches this call may replay: its buffer's (op, shape, dtype, cfg, parity)
        and the 16-byte alignment of its tensors (the kernels' vector paths depend on it); None where
        calls are not replayed (a per-message codec, `numel` elements a rank pipelined, or a tensor
        that is not contiguous: the checked path reads a copy of it, a replay its own address)."""
        if not isinstance(self.codec, CudaCodec) or self.plan(numel)[0] > 1:
            return None
        if not all(t.is_contiguous() for t in tensors):
            return None
        base = (op, shape, dtype, cfg)
        return (*base, self._parity(base), *(t.data_ptr() % 16 for t in tensors))

    @contextmanager
    def _recording(self, key: Hashable | None, *kernels: str) -> Iterator[None]:
        """Runs the checked path; the first time for `key`, keeps its launches for replay when they
        are those of `kernels`, in order (else none: e.g. an empty message launches nothing, and one
        rank's sums are copies)."""
        if key is None or key in self._replays:
            yield
            return
        with recording() as launched:
            yield
        self._replays[key] = tuple(launched) if tuple(la.kernel.name for la in launched) == kernels else None

    def _messages(self, buf: torch.Tensor, lo: int, hi: int, shape: tuple[int, ...], dtype: torch.dtype,
                  cfg: QuantConfig) -> list[Compressed]:
        """Bytes [lo, hi) of every rank's buffer (rank order), as packed messages read in place."""
        key = (buf.data_ptr(), lo, hi, shape, dtype, cfg)
        if key not in self._views:
            self._views[key] = [packed_view(self.t.peer(buf, p)[lo:hi], shape, dtype, cfg) for p in range(self.t.world_size)]
        return self._views[key]

    # -- the collectives ------------------------------------------------------------------------
    def _exchange(self, op: str, x: torch.Tensor, cfg: QuantConfig,
                  consume: Callable[[list[Compressed], int, int, FusedBarrier | None], None],
                  own_out: torch.Tensor | None = None) -> Hashable:
        """An all-gather's exchange: x compressed into this rank's buffer (and, with `own_out`, its
        decompression written there by the same pass: elements [lo, hi) to own_out[lo:hi]), then
        every rank's message (rank order, read in place) handed to `consume(messages, lo, hi,
        barrier)` for elements [lo, hi) of x. Unpipelined: one piece, a barrier between (`barrier`: for the reading launch to
        perform, or None if queued already). Pipelined: piece k packed at k * stride, published to
        every rank, consumed as it lands. Returns the buffer's key (the caller records the read)."""
        numel = x.numel()
        n, piece = self.plan(numel)
        stride, wire = cfg.packed_stride(piece), cfg.wire_bytes(piece)
        key, buf = self._buffer(op, tuple(x.shape), x.dtype, cfg, n * stride)
        flat = x.reshape(-1)

        def messages(k: int) -> list[Compressed]:
            return self._messages(buf, k * stride, k * stride + wire, (piece,), x.dtype, cfg)

        def own(lo: int, hi: int) -> torch.Tensor | None:
            return None if own_out is None else own_out[lo:hi]

        if n == 1:
            self.codec.compress_into(flat, cfg, buf[:wire], own_out=own(0, numel))
            barrier = self._read_barrier()  # before the peers' views (a fake transport makes them lazily)
            consume(messages(0), 0, numel, barrier)
        else:
            everyone = range(self.t.world_size)
            self.epoch += 1
            self._pipeline(n, lambda k: self.codec.compress_into(flat[k * piece:(k + 1) * piece], cfg,
                                                                 buf[k * stride:k * stride + wire],
                                                                 own_out=own(k * piece, (k + 1) * piece)),
                           lambda k: consume(messages(k), k * piece, (k + 1) * piece, None), everyone, everyone)
        return key

    def all_gather(self, x: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
        """Every rank's x concatenated along dim 0, each decompressed from its owner's buffer; this
        rank's own part written by its compression pass (the same bits, not read back)."""
        _check_input(x, self.t.device)
        world, rank = self.t.world_size, self.t.rank
        out = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
        replay_key = self._replay_key("all_gather", tuple(x.shape), x.dtype, cfg, x.numel(), x, out)
        replay = self._replays.get(replay_key)
        if replay:
            compress, gather = replay
            key, _ = self._buffer("all_gather", tuple(x.shape), x.dtype, cfg, cfg.packed_stride(x.numel()))
            base = out.data_ptr()
            compress(x=x.data_ptr(), own_out=base + rank * x.numel() * x.element_size())
            gather(out=base, barrier=barrier_arg(self._read_barrier()))
        else:
            rows = out.view(world, -1)
            with self._recording(replay_key, "taco_compress", "taco_gather"):
                key = self._exchange("all_gather", x, cfg,
                                     lambda ms, lo, hi, bar: self.codec.gather_into(ms, rows[:, lo:hi], bar, skip=rank),
                                     own_out=rows[rank])
        self._read(key)
        return out.view(world * x.shape[0], *x.shape[1:])

    def _scatter(self, op: str, x: torch.Tensor, cfg: QuantConfig,
                 consume: Callable[[int, list[Compressed | torch.Tensor], int, int, FusedBarrier | None], None]) -> Hashable:
        """A reduce-scatter's exchange: chunk q != rank of x (split along dim 0) compressed into
        segment q of this rank's buffer, then this rank's parts of the sum in rank order (segment
        `rank` of every other rank's buffer, and its own chunk exactly) handed to
        `consume(k, parts, lo, hi, barrier)` for elements [lo, hi) of the chunk. Unpipelined: one
        piece, a barrier between (as in `_exchange`). Pipelined: piece k of every segment compressed at once (segments of piece
        k packed at (k * W + q) * stride), published to every peer, consumed as it lands. Returns the
        buffer's key (the caller records the read)."""
        world, rank = self.t.world_size, self.t.rank
        numel = x.numel() // world
        n, piece = self.plan(numel)
        stride, wire = cfg.packed_stride(piece), cfg.wire_bytes(piece)
        key, buf = self._buffer(op, tuple(x.shape), x.dtype, cfg, n * world * stride)
        rows = x.reshape(world, numel)

        def parts(k: int) -> list[Compressed | torch.Tensor]:
            lo = (k * world + rank) * stride
            found: list[Compressed | torch.Tensor] = list(self._messages(buf, lo, lo + wire, (piece,), x.dtype, cfg))
            found[rank] = rows[rank, k * piece:(k + 1) * piece]  # own chunk, exact (as the reference)
            return found

        # the own chunk is never sent: one rank compresses nothing (its buffer holds no whole segment)
        if n == 1:
            if world > 1:
                self.codec.compress_into(rows, cfg, buf, segments=world, skip=rank)
            barrier = self._read_barrier()
            consume(0, parts(0), 0, numel, barrier)
        else:
            peers = [p for p in range(world) if p != rank]
            self.epoch += 1

            def compress(k: int) -> None:
                if world > 1:
                    self.codec.compress_into(rows[:, k * piece:(k + 1) * piece], cfg,
                                             buf[k * world * stride:(k + 1) * world * stride], segments=world, skip=rank)

            self._pipeline(n, compress, lambda k: consume(k, parts(k), k * piece, (k + 1) * piece, None), peers, peers)
        return key

    def reduce_scatter(self, x: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
        """Chunk `rank` (of x split along dim 0) summed over ranks (see _scatter)."""
        _check_input(x, self.t.device)
        world, rank = self.t.world_size, self.t.rank
        _check_dim0(x, world)
        out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
        chunk = out.numel()
        replay_key = self._replay_key("reduce_scatter", tuple(x.shape), x.dtype, cfg, chunk, x, out)
        replay = self._replays.get(replay_key)
        if replay:
            compress, reduce = replay
            key, _ = self._buffer("reduce_scatter", tuple(x.shape), x.dtype, cfg, world * cfg.packed_stride(chunk))
            compress(x=x.data_ptr())
            self._sum_with_own(reduce, x.data_ptr() + rank * chunk * x.element_size(), out=out.data_ptr(),
                               barrier=barrier_arg(self._read_barrier()))
        else:
            flat = out.view(-1)
            with self._recording(replay_key, "taco_compress", "taco_sum"):
                key = self._scatter("reduce_scatter", x, cfg,
                                    lambda k, parts, lo, hi, bar: self.codec.sum_into(parts, flat[lo:hi], bar))
        self._read(key)
        return out

    def _sum_with_own(self, launch: Launch, own: int, **values: int | bytes) -> None:
        """A replayed sum whose sources hold this rank's own chunk raw (a reduce-scatter's, two-shot's
        first phase): that address is the call's, the peers' messages are the buffers' as recorded."""
        sources = source_addresses(launch.value("sources"), self.t.world_size)
        sources[self.t.rank] = own
        launch(sources=sources_arg(sources), **values)

    def all_reduce(self, x: torch.Tensor, cfg: QuantConfig, algorithm: AllReduceAlgo) -> torch.Tensor:
        """one_shot: every rank reads every rank's whole compressed x and sums in FP32.
        two_shot: compressed reduce-scatter of the group-padded flat tensor, the reduced chunk
        requantized (in x's dtype) by the summing kernel itself, compressed all-gather: the
        reference's steps exactly (two barriers unpipelined; pipelined, per-piece flags)."""
        if algorithm not in ("one_shot", "two_shot"):
            raise ValueError(f"algorithm must be 'one_shot' or 'two_shot', got {algorithm!r}")
        _check_input(x, self.t.device)
        world = self.t.world_size
        if algorithm == "one_shot":
            out = torch.empty_like(x)
            replay_key = self._replay_key("one_shot", tuple(x.shape), x.dtype, cfg, x.numel(), x, out)
            replay = self._replays.get(replay_key)
            if replay:
                compress, reduce = replay
                key, _ = self._buffer("one_shot", tuple(x.shape), x.dtype, cfg, cfg.packed_stride(x.numel()))
                compress(x=x.data_ptr())
                reduce(out=out.data_ptr(), barrier=barrier_arg(self._read_barrier()))
            else:
                out_flat = out.view(-1)
                with self._recording(replay_key, "taco_compress", "taco_sum"):
                    key = self._exchange("one_shot", x, cfg,
                                         lambda ms, lo, hi, bar: self.codec.sum_into(ms, out_flat[lo:hi], bar))
            self._read(key)
            return out
        flat = x.reshape(-1)
        per_rank = -(-flat.numel() // (world * cfg.group_size)) * cfg.group_size
        short = per_rank * world - flat.numel()  # padding to whole groups per rank (a copy only when needed)
        padded = (torch.nn.functional.pad(flat, (0, short)) if short else flat).view(world, per_rank)
        full = torch.empty((world, per_rank), dtype=x.dtype, device=x.device)
        replay_key = self._replay_key("two_shot_scatter", (world, per_rank), x.dtype, cfg, per_rank, padded, full)
        replay = self._replays.get(replay_key)
        if replay:
            self._two_shot_replay(replay, padded, full, cfg)
        else:
            with self._recording(replay_key, "taco_compress", "taco_sum_compress", "taco_gather"):
                self._two_shot(padded, full, cfg)
        return full.reshape(-1)[: flat.numel()].view(x.shape)

    def _two_shot_replay(self, replay: tuple[Launch, ...], padded: torch.Tensor, full: torch.Tensor,
                         cfg: QuantConfig) -> None:
        """`_two_shot`'s launches replayed (unpipelined): the same buffers and barriers, in order."""
        compress, requantize, gather = replay
        world, per_rank = padded.shape
        stride, own = cfg.packed_stride(per_rank), self.t.rank * per_rank * padded.element_size()
        key1, _ = self._buffer("two_shot_scatter", (world, per_rank), padded.dtype, cfg, world * stride)
        compress(x=padded.data_ptr())
        barrier = barrier_arg(self._read_barrier())
        key2, _ = self._buffer("two_shot_gather", (1, per_rank), padded.dtype, cfg, stride)
        self._sum_with_own(requantize, padded.data_ptr() + own, own_out=full.data_ptr() + own, barrier=barrier)
        self._read(key1)
        gather(out=full.data_ptr(), barrier=barrier_arg(self._read_barrier()))
        self._read(key2)

    def _two_shot(self, padded: torch.Tensor, full: torch.Tensor, cfg: QuantConfig) -> None:
        """Two-shot all-reduce of `padded` ([W, per_rank], whole groups per rank) into `full` (the
        same shape): phase 1 a reduce-scatter's exchange whose sum is requantized, phase 2 an
        all-gather of the requantized chunks."""
        world, per_rank = padded.shape
        everyone = range(world)
        n, piece = self.plan(per_rank)  # the same pieces in both phases
        stride, wire = cfg.packed_stride(piece), cfg.wire_bytes(piece)
        phase2: dict[str, Any] = {}

        def requantize(k: int, parts: list[Compressed | torch.Tensor], lo: int, hi: int,
                       barrier: FusedBarrier | None) -> None:
            """The reduced piece, requantized in x's dtype into phase 2's buffer (then published),
            and its decompression written into this rank's part of the result by the same pass.
            That buffer is taken at the first piece: after phase 1's (and its rewrite barrier)."""
            if not phase2:
                phase2["key"], phase2["buf"] = self._buffer("two_shot_gather", (1, per_rank), padded.dtype, cfg,
                                                            n * stride)
            self.codec.sum_compress_into(parts, padded.dtype, cfg, phase2["buf"][k * stride:k * stride + wire], barrier,
                                         own_out=full[self.t.rank, lo:hi])
            if n > 1:
                self.t.publish(MAX_PIECES + k, self.epoch, everyone)

        key1 = self._scatter("two_shot_scatter", padded, cfg, requantize)  # phase 1: a reduce-scatter's exchange
        self._read(key1)
        key2, buf2 = phase2["key"], phase2["buf"]
        barrier = self._read_barrier() if n == 1 else None
        for k in range(n):  # phase 2: an all-gather of the requantized pieces (pipelined: as they are published)
            if n > 1:
                self.t.wait(MAX_PIECES + k, self.epoch, everyone)
            self.codec.gather_into(self._messages(buf2, k * stride, k * stride + wire, (piece,), padded.dtype, cfg),
                                   full[:, k * piece:(k + 1) * piece], barrier, skip=self.t.rank)
        self._read(key2)

    def close(self) -> None:
        """Collective: a last barrier if peers may still be reading, so buffers can be released."""
        if any(at in (self.barriers, ANY_TIME) for at in self._read_at.values()):
            self._barrier()
        self._views.clear()
        self._replays.clear()


def _check_input(x: torch.Tensor, device: torch.device) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"the device backend compresses float32, float16 or bfloat16 tensors, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"the tensor is on {x.device}, the backend's ranks on {device}")
    if x.dim() == 0:
        raise ValueError("the collectives need a tensor with at least one dimension (they concatenate/split dim 0)")


def _check_dim0(x: torch.Tensor, world: int) -> None:
    if x.shape[0] % world:
        raise ValueError(f"reduce_scatter: dim 0 of shape {tuple(x.shape)} must be divisible by the world size {world}")


def _flag_word(table: int, source: int, slot: int) -> int:
    """The address of flag [source][slot] in a flag table at address `table` (any rank's copy)."""
    return table + 8 * (source * (FLAG_SLOTS + 1) + slot)


class WindowTransport:
    """A RankContext's symmetric windows: buffers from `ctx.symmetric`, peers' via `ctx.peer_tensor`
    (NVLink loads by the kernels), barrier `ctx.device_barrier()` (LSA, acq_rel) on the current stream."""

    def __init__(self, ctx: Any):
        self.ctx = ctx
        self.rank, self.world_size, self.device = ctx.rank, ctx.world_size, ctx.device
        self._buffers: dict[Hashable, torch.Tensor] = {}
        self._peers: dict[tuple[int, int, int], torch.Tensor] = {}
        self._stream: torch.cuda.Stream | None = None  # the stream of the last call
        self._flags: torch.Tensor | None = None  # [W, FLAG_SLOTS + 1] int64: [source][slot] = its last epoch
        self._flag_peers: list[int] = []  # each rank's flags' address, as mapped here

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
        """Flag words [source][BARRIER_SLOT] of the flag table: signal every peer, wait for every
        peer. None while the stream is captured into a CUDA graph (the epoch is a host value that a
        replay would repeat): then a barrier kernel, as before."""
        if self.capturing():
            return None
        flags, peers = self._flag_table()
        others = [p for p in range(self.world_size) if p != self.rank]
        return FusedBarrier(signal=tuple(_flag_word(peers[d], self.rank, BARRIER_SLOT) for d in others),
                            wait=tuple(_flag_word(flags.data_ptr(), s, BARRIER_SLOT) for s in others), epoch=epoch)

    # pipelined calls: flags written by stream memory operations (cuStreamWriteValue64 into the
    # peer's mapped window after the compression, cuStreamWaitValue64 on the local word): no kernel
    # and no SM spent waiting, and the write's default memory barrier orders the payload before it
    def _flag_table(self) -> tuple[torch.Tensor, list[int]]:
        if self._flags is None:  # collective, at the first pipelined call (same order on every rank)
            self._flags = self.ctx.symmetric((self.world_size, FLAG_SLOTS + 1), torch.int64)
            self._flag_peers = [self.peer(self._flags, p).data_ptr() for p in range(self.world_size)]
        return self._flags, self._flag_peers

    @contextmanager
    def side(self) -> Iterator[None]:
        self._flag_table()  # allocated (zeroed, ranks lined up) before any publish or wait
        side = self.ctx.stream("taco")
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            yield

    def join(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.ctx.stream("taco"))

    def publish(self, slot: int, epoch: int, ranks: Sequence[int]) -> None:
        from commweave.runtime.launch import stream_write

        _, peers = self._flag_table()
        for d in ranks:
            stream_write(_flag_word(peers[d], self.rank, slot), epoch)

    def wait(self, slot: int, epoch: int, ranks: Sequence[int]) -> None:
        from commweave.runtime.launch import stream_wait_geq

        flags, _ = self._flag_table()
        for s in ranks:
            stream_wait_geq(_flag_word(flags.data_ptr(), s, slot), epoch)


class DeviceBackend:
    """`collectives.CollectiveBackend` over CUDA symmetric windows, registered as "device".

    The context is the one given, else `commweave.ops.context()` (this process's RankContext over
    the default process group, made collectively at first use): the simplest consistent choice,
    since the windows must belong to one communicator over the same ranks as the group. Only the
    default group (group=None or WORLD) is supported. One `DeviceCollectives` (its buffers) per
    context; a new context (after `commweave.ops.close()`) starts a new one. `codec`: "cuda" (the
    default: fused multi-rank kernels) or "triton" (one launch per message; for comparison).
    `fuse_barriers` (CUDA codec only; off until measured on several GPUs): the reading kernels
    perform the barrier between a call's writes and its reads themselves, instead of a barrier
    kernel queued before them (which costs a launch gap and ~3.5 µs on 2 H200s).
    `double_buffer`, `pieces`: see the module's docstring."""

    def __init__(self, ctx: Any = None, double_buffer: bool = True, codec: str = "cuda", pieces: int = 1,
                 compress_blocks: int | None = None, fuse_barriers: bool = False):
        if codec not in ("cuda", "triton"):
            raise ValueError(f"codec must be 'cuda' or 'triton' on GPUs, got {codec!r}")
        if not 1 <= pieces <= MAX_PIECES:
            raise ValueError(f"pieces must be in 1..{MAX_PIECES}, got {pieces}")
        if compress_blocks is not None and (codec != "cuda" or compress_blocks < 1):
            raise ValueError(f"compress_blocks caps the CUDA codec's compression grid: a positive count with codec "
                             f"'cuda', got {compress_blocks} with codec {codec!r}")
        if fuse_barriers and codec != "cuda":
            raise ValueError(f"only the CUDA codec's kernels perform barriers themselves, not codec {codec!r}'s")
        self._ctx = ctx
        self.double_buffer = double_buffer
        self.codec = codec
        self.pieces = pieces
        self.compress_blocks = compress_blocks
        self.fuse_barriers = fuse_barriers
        self._state: tuple[Any, DeviceCollectives] | None = None

    def collectives(self, x: torch.Tensor, group: Any = None) -> DeviceCollectives:
        """The algorithms bound to this backend's context, after checking x and group."""
        if not isinstance(x, torch.Tensor) or x.device.type != "cuda":
            where = x.device if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"the device backend needs CUDA tensors, got {where}; use backend='reference' on CPU")
        if group is not None and group is not dist.group.WORLD:
            raise ValueError("the device backend runs over the default process group only (its RankContext's "
                             "windows); pass group=None or use backend='reference' for subgroups")
        ctx = self._ctx
        if ctx is None:
            from commweave.ops import context

            ctx = context(x.device)
        if not ctx.is_cuda:
            raise ValueError(f"the device backend needs a CUDA RankContext, this one is on {ctx.device}")
        if x.device != ctx.device:
            raise ValueError(f"the tensor is on {x.device}, the context on {ctx.device}")
        if self._state is None or self._state[0] is not ctx:
            self._state = (ctx, DeviceCollectives(WindowTransport(ctx), self._make_codec(), self.double_buffer,
                                                      self.pieces))
        return self._state[1]

    def _make_codec(self) -> Codec:
        return CudaCodec(self.compress_blocks, self.fuse_barriers) if self.codec == "cuda" else TritonCodec()

    def all_gather(self, x: torch.Tensor, cfg: QuantConfig, group: Any = None) -> torch.Tensor:
        coll = self.collectives(x, group)
        with on_device(x.device):
            return coll.all_gather(x.contiguous(), cfg)

    def reduce_scatter(self, x: torch.Tensor, cfg: QuantConfig, group: Any = None) -> torch.Tensor:
        coll = self.collectives(x, group)
        with on_device(x.device):
            return coll.reduce_scatter(x.contiguous(), cfg)

    def all_reduce(self, x: torch.Tensor, cfg: QuantConfig, algorithm: AllReduceAlgo, group: Any = None) -> torch.Tensor:
        coll = self.collectives(x, group)
        with on_device(x.device):
            return coll.all_reduce(x.contiguous(), cfg, algorithm)

    def close(self) -> None:
        """Collective: a final barrier if needed and forget the buffers (the context keeps the
        windows until its end_candidate / close)."""
        if self._state is not None:
            ctx, coll = self._state
            with torch.cuda.device(ctx.device):
                coll.close()
                torch.cuda.synchronize(ctx.device)
            self._state = None


register_backend("device", DeviceBackend())
