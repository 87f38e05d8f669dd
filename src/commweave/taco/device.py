"""Device-initiated compressed collectives: the "device" backend of `taco.collectives`.

On CUDA within one node: each rank compresses into its own symmetric buffer (one launch, every
chunk of a reduce-scatter at once), a barrier makes the bytes visible, then one kernel reads every
rank's message from their windows over NVLink and decompresses them into their places (all-gather)
or sums them in FP32 in rank order and casts once (reduce-scatter, all-reduce), all on the
caller's stream. The steps are the reference backend's, so with a codec that gives the reference's
bits the results equal `collectives.ReferenceBackend`'s bit for bit, and are the same on every rank.

Built from `transport` (windows, barrier), `codec` (the kernels), `hazards` (when a rewrite needs a
barrier), `buffers` (double buffering) and `replay` (recorded launches). Collective: every rank
makes the same calls in the same order with the same shapes, dtypes and configs; the first call of
a layout allocates its windows.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch
from torch.distributed import ProcessGroup

from commweave.runtime.default import context as default_context
from commweave.runtime.launch import on_device
from commweave.taco.backend import AllReduceAlgo, Group, resolve_group
from commweave.taco.buffers import Buffers
from commweave.taco.codec import Codec, CudaCodec, TritonCodec
from commweave.taco.cuda import FusedBarrier, Launch, barrier_arg
from commweave.taco.hazards import RewriteBarriers
from commweave.taco.replay import Replays, sum_with_own
from commweave.taco.transport import Transport, WindowTransport
from commweave.taco.wire import Compressed, QuantConfig

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class DeviceCollectives:
    """The compressed collectives over a Transport and a Codec."""

    def __init__(self, transport: Transport, codec: Codec, double_buffer: bool = False):
        self.t = transport
        self.codec = codec
        self.hazards = RewriteBarriers()
        self.buffers = Buffers(transport, double_buffer)
        self.replays = Replays(isinstance(codec, CudaCodec))

    @property
    def barriers(self) -> int:
        """Barriers so far, queued or fused (identical on every rank)."""
        return self.hazards.barriers

    # -- buffers and ordering ------------------------------------------------------------------
    def _barrier(self) -> None:
        self.t.barrier()
        self.hazards.counted()

    def _read_barrier(self) -> FusedBarrier | None:
        """The barrier between this call's writes and its reads: handed to the reading launch where
        the codec and the transport can fuse it (returned), else queued now (None). Either kind
        counts for the rewrite rule: every rank signals it after its earlier reads, and waits for
        every rank's signal before reading (or writing again)."""
        epoch = self.hazards.counted()
        fused = self.t.fused_barrier(epoch) if self.codec.fuses_barriers else None
        if fused is None:
            self.t.barrier()
        return fused

    def _buffer(self, op: str, shape: tuple[int, ...], dtype: torch.dtype, cfg: QuantConfig,
                nbytes: int) -> tuple[Hashable, torch.Tensor]:
        """This call's buffer, after a barrier if peers may still read its last contents."""
        key, buf = self.buffers.take((op, shape, dtype, cfg), nbytes)
        if self.hazards.before_write(key, self.t.capturing()):
            self._barrier()
        return key, buf

    def _read(self, key: Hashable) -> None:
        self.hazards.read(key, self.t.capturing())

    def _replay_key(self, op: str, shape: tuple[int, ...], dtype: torch.dtype, cfg: QuantConfig,
                    *tensors: torch.Tensor) -> Hashable | None:
        base = (op, shape, dtype, cfg)
        return self.replays.key(base, self.buffers.parity(base), *tensors)

    # -- the exchanges ---------------------------------------------------------------------------
    def _exchange(self, op: str, x: torch.Tensor, cfg: QuantConfig,
                  own_out: torch.Tensor | None = None) -> tuple[Hashable, list[Compressed], FusedBarrier | None]:
        """An all-gather's exchange: x compressed into this rank's buffer (with `own_out`, its
        decompression written there by the same pass), the read barrier, and every rank's message
        (rank order, read in place). Returns the buffer's key (the caller records the read), the
        messages and the barrier for the reading launch (None: queued already)."""
        numel = x.numel()
        wire = cfg.wire_bytes(numel)
        key, buf = self._buffer(op, tuple(x.shape), x.dtype, cfg, cfg.packed_stride(numel))
        self.codec.compress_into(x.reshape(-1), cfg, buf[:wire], own_out=own_out)
        barrier = self._read_barrier()  # before the peers' views (a fake transport makes them lazily)
        return key, self.buffers.messages(buf, 0, wire, (numel,), x.dtype, cfg), barrier

    def _scatter(self, op: str, x: torch.Tensor,
                 cfg: QuantConfig) -> tuple[Hashable, list[Compressed | torch.Tensor], FusedBarrier | None]:
        """A reduce-scatter's exchange: chunk q != rank of x (split along dim 0) compressed into
        segment q of this rank's buffer, the read barrier, and this rank's parts of the sum in rank
        order (segment `rank` of every other rank's buffer, its own chunk exactly). Returns the
        buffer's key, the parts and the barrier, as `_exchange`."""
        world, rank = self.t.world_size, self.t.rank
        numel = x.numel() // world
        stride, wire = cfg.packed_stride(numel), cfg.wire_bytes(numel)
        key, buf = self._buffer(op, tuple(x.shape), x.dtype, cfg, world * stride)
        rows = x.reshape(world, numel)
        if world > 1:  # the own chunk is never sent: one rank compresses nothing
            self.codec.compress_into(rows, cfg, buf, segments=world, skip=rank)
        barrier = self._read_barrier()
        parts: list[Compressed | torch.Tensor] = list(
            self.buffers.messages(buf, rank * stride, rank * stride + wire, (numel,), x.dtype, cfg))
        parts[rank] = rows[rank]  # own chunk, exact (as the reference)
        return key, parts, barrier

    # -- the collectives ------------------------------------------------------------------------
    def all_gather(self, x: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
        """Every rank's x concatenated along dim 0, each decompressed from its owner's buffer; this
        rank's own part written by its compression pass (the same bits, not read back)."""
        _check_input(x, self.t.device)
        world, rank = self.t.world_size, self.t.rank
        out = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
        replay_key = self._replay_key("all_gather", tuple(x.shape), x.dtype, cfg, x, out)
        replay = self.replays.get(replay_key)
        if replay:
            compress, gather = replay
            key, _ = self._buffer("all_gather", tuple(x.shape), x.dtype, cfg, cfg.packed_stride(x.numel()))
            base = out.data_ptr()
            compress(x=x.data_ptr(), own_out=base + rank * x.numel() * x.element_size())
            gather(out=base, barrier=barrier_arg(self._read_barrier()))
        else:
            rows = out.view(world, -1)
            with self.replays.recording(replay_key, "taco_compress", "taco_gather"):
                key, messages, barrier = self._exchange("all_gather", x, cfg, own_out=rows[rank])
                self.codec.gather_into(messages, rows, barrier, skip=rank)
        self._read(key)
        return out.view(world * x.shape[0], *x.shape[1:])

    def reduce_scatter(self, x: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
        """Chunk `rank` (of x split along dim 0) summed over ranks in FP32, in rank order."""
        _check_input(x, self.t.device)
        world, rank = self.t.world_size, self.t.rank
        _check_dim0(x, world)
        out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
        chunk = out.numel()
        replay_key = self._replay_key("reduce_scatter", tuple(x.shape), x.dtype, cfg, x, out)
        replay = self.replays.get(replay_key)
        if replay:
            compress, reduce = replay
            key, _ = self._buffer("reduce_scatter", tuple(x.shape), x.dtype, cfg, world * cfg.packed_stride(chunk))
            compress(x=x.data_ptr())
            sum_with_own(reduce, x.data_ptr() + rank * chunk * x.element_size(), rank, world, out=out.data_ptr(),
                         barrier=barrier_arg(self._read_barrier()))
        else:
            with self.replays.recording(replay_key, "taco_compress", "taco_sum"):
                key, parts, barrier = self._scatter("reduce_scatter", x, cfg)
                self.codec.sum_into(parts, out.view(-1), barrier)
        self._read(key)
        return out

    def all_reduce(self, x: torch.Tensor, cfg: QuantConfig, algorithm: AllReduceAlgo) -> torch.Tensor:
        """one_shot: every rank reads every rank's whole compressed x and sums in FP32.
        two_shot: compressed reduce-scatter of the group-padded flat tensor, the reduced chunk
        requantized (in x's dtype) by the summing kernel itself, compressed all-gather: the
        reference's steps exactly, two barriers."""
        if algorithm not in ("one_shot", "two_shot"):
            raise ValueError(f"algorithm must be 'one_shot' or 'two_shot', got {algorithm!r}")
        _check_input(x, self.t.device)
        world = self.t.world_size
        if algorithm == "one_shot":
            out = torch.empty_like(x)
            replay_key = self._replay_key("one_shot", tuple(x.shape), x.dtype, cfg, x, out)
            replay = self.replays.get(replay_key)
            if replay:
                compress, reduce = replay
                key, _ = self._buffer("one_shot", tuple(x.shape), x.dtype, cfg, cfg.packed_stride(x.numel()))
                compress(x=x.data_ptr())
                reduce(out=out.data_ptr(), barrier=barrier_arg(self._read_barrier()))
            else:
                with self.replays.recording(replay_key, "taco_compress", "taco_sum"):
                    key, messages, barrier = self._exchange("one_shot", x, cfg)
                    self.codec.sum_into(messages, out.view(-1), barrier)
            self._read(key)
            return out
        flat = x.reshape(-1)
        per_rank = -(-flat.numel() // (world * cfg.group_size)) * cfg.group_size
        short = per_rank * world - flat.numel()  # padding to whole groups per rank (a copy only when needed)
        padded = (torch.nn.functional.pad(flat, (0, short)) if short else flat).view(world, per_rank)
        full = torch.empty((world, per_rank), dtype=x.dtype, device=x.device)
        replay_key = self._replay_key("two_shot_scatter", (world, per_rank), x.dtype, cfg, padded, full)
        replay = self.replays.get(replay_key)
        if replay:
            self._two_shot_replay(replay, padded, full, cfg)
        else:
            with self.replays.recording(replay_key, "taco_compress", "taco_sum_compress", "taco_gather"):
                self._two_shot(padded, full, cfg)
        return full.reshape(-1)[: flat.numel()].view(x.shape)

    def _two_shot(self, padded: torch.Tensor, full: torch.Tensor, cfg: QuantConfig) -> None:
        """Two-shot all-reduce of `padded` ([W, per_rank], whole groups per rank) into `full` (the
        same shape): phase 1 a reduce-scatter's exchange whose sum is requantized into phase 2's
        buffer (taken after phase 1's read barrier) and, by the same pass, decompressed into this
        rank's part of the result; phase 2 an all-gather of the requantized chunks."""
        world, per_rank = padded.shape
        rank = self.t.rank
        wire = cfg.wire_bytes(per_rank)
        key1, parts, barrier = self._scatter("two_shot_scatter", padded, cfg)
        key2, buf2 = self._buffer("two_shot_gather", (1, per_rank), padded.dtype, cfg, cfg.packed_stride(per_rank))
        self.codec.sum_compress_into(parts, padded.dtype, cfg, buf2[:wire], barrier, own_out=full[rank])
        self._read(key1)
        barrier = self._read_barrier()
        self.codec.gather_into(self.buffers.messages(buf2, 0, wire, (per_rank,), padded.dtype, cfg), full, barrier,
                               skip=rank)
        self._read(key2)

    def _two_shot_replay(self, replay: tuple[Launch, ...], padded: torch.Tensor, full: torch.Tensor,
                         cfg: QuantConfig) -> None:
        """`_two_shot`'s launches replayed: the same buffers and barriers, in order."""
        compress, requantize, gather = replay
        world, per_rank = padded.shape
        rank = self.t.rank
        stride, own = cfg.packed_stride(per_rank), rank * per_rank * padded.element_size()
        key1, _ = self._buffer("two_shot_scatter", (world, per_rank), padded.dtype, cfg, world * stride)
        compress(x=padded.data_ptr())
        barrier = barrier_arg(self._read_barrier())
        key2, _ = self._buffer("two_shot_gather", (1, per_rank), padded.dtype, cfg, stride)
        sum_with_own(requantize, padded.data_ptr() + own, rank, world, own_out=full.data_ptr() + own, barrier=barrier)
        self._read(key1)
        gather(out=full.data_ptr(), barrier=barrier_arg(self._read_barrier()))
        self._read(key2)

    def close(self) -> None:
        """Collective: a last barrier if peers may still be reading, so buffers can be released."""
        if self.hazards.pending():
            self._barrier()
        self.buffers.clear()
        self.replays.clear()


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


class DeviceBackend:
    """`backend.CollectiveBackend` over CUDA symmetric windows: backend "device" of `collectives`.

    Runs in the rank context given, else in `runtime.default.context(device, group=...)`: the
    process's context over the call's group (made collectively at its first use), since the windows
    must belong to one communicator over the group's ranks. One `DeviceCollectives` (its buffers)
    per group; a new context for a group starts a new one. `codec`: "cuda" (fused multi-rank
    kernels, the default) or "triton" (one launch per message). `fuse_barriers` (CUDA codec): the
    reading kernels perform the read barrier themselves instead of a barrier kernel queued before
    them. `double_buffer`: see `buffers`."""

    def __init__(self, ctx: Any = None, double_buffer: bool = True, codec: str = "cuda", fuse_barriers: bool = False):
        if codec not in ("cuda", "triton"):
            raise ValueError(f"codec must be 'cuda' or 'triton' on GPUs, got {codec!r}")
        if fuse_barriers and codec != "cuda":
            raise ValueError(f"only the CUDA codec's kernels perform barriers themselves, not codec {codec!r}'s")
        self._ctx = ctx
        self.double_buffer = double_buffer
        self.codec = codec
        self.fuse_barriers = fuse_barriers
        self._states: dict[ProcessGroup | None, tuple[Any, DeviceCollectives]] = {}

    def context(self, device: torch.device, group: Group = None) -> Any:
        """The rank context of a call on `device` over `group`, checked."""
        group = resolve_group(group)
        ctx = self._ctx
        if ctx is None:
            # runtime.default keeps one context per process group; the default group's is the plain call
            ctx = default_context(device) if group is None else default_context(device, group=group)
        elif resolve_group(ctx.group) is not group:
            raise ValueError("the call's group is not the one of the context this backend was given: leave ctx=None "
                             "(the process's context per group) or give a DeviceBackend that group's context")
        if not ctx.is_cuda:
            raise ValueError(f"the device backend needs a CUDA RankContext, this one is on {ctx.device}")
        if device != ctx.device:
            raise ValueError(f"the tensor is on {device}, the context on {ctx.device}")
        return ctx

    def collectives(self, x: torch.Tensor, group: Group = None) -> DeviceCollectives:
        """The algorithms bound to the context of x's device and `group`, after checking x."""
        if not isinstance(x, torch.Tensor) or x.device.type != "cuda":
            where = x.device if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"the device backend needs CUDA tensors, got {where}; use backend='reference' on CPU")
        group = resolve_group(group)
        ctx = self.context(x.device, group)
        state = self._states.get(group)
        if state is None or state[0] is not ctx:
            codec: Codec = CudaCodec(self.fuse_barriers) if self.codec == "cuda" else TritonCodec()
            state = self._states[group] = (ctx, DeviceCollectives(WindowTransport(ctx), codec, self.double_buffer))
        return state[1]

    def all_gather(self, x: torch.Tensor, cfg: QuantConfig, group: Group = None) -> torch.Tensor:
        coll = self.collectives(x, group)
        with on_device(x.device):
            return coll.all_gather(x.contiguous(), cfg)

    def reduce_scatter(self, x: torch.Tensor, cfg: QuantConfig, group: Group = None) -> torch.Tensor:
        coll = self.collectives(x, group)
        with on_device(x.device):
            return coll.reduce_scatter(x.contiguous(), cfg)

    def all_reduce(self, x: torch.Tensor, cfg: QuantConfig, algorithm: AllReduceAlgo, group: Group = None) -> torch.Tensor:
        coll = self.collectives(x, group)
        with on_device(x.device):
            return coll.all_reduce(x.contiguous(), cfg, algorithm)

    def close(self) -> None:
        """Collective: a final barrier where needed and forget the buffers (the contexts keep the
        windows until their end_candidate / close)."""
        for ctx, coll in self._states.values():
            with torch.cuda.device(ctx.device):
                coll.close()
                torch.cuda.synchronize(ctx.device)
        self._states.clear()
