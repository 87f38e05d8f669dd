"""One interface for TACO's three implementations of the quantizer: the `Codec` protocol.

A codec compresses a tensor, decompresses a message, and does the collectives' steps: compress
(chunks) into a buffer, decompress a set of messages into their places, or sum them in FP32 in
order. `quant.ReferenceCodec` (torch, any device), `TritonCodec` (`kernels.py`, one launch per
message) and `CudaCodec` (`cuda.py`, one launch per step) give the same bits; `quant.codec(impl)`
picks one by name, for `quant.compress(..., impl=)` and the device collectives alike.

The kernel modules are imported when a codec is made (Triton may be absent; neither is needed by
the reference), so importing this module imports only the wire format.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from commweave.taco.wire import Compressed, QuantConfig, packed_view

if TYPE_CHECKING:
    from commweave.taco.cuda import FusedBarrier

Impl = Literal["reference", "triton", "cuda"]


class Codec(Protocol):
    fuses_barriers: bool  # its reading calls take a FusedBarrier (else the collectives queue a barrier)

    def compress(self, x: torch.Tensor, cfg: QuantConfig) -> Compressed:
        """`x` compressed (any shape, floating point)."""
        ...

    def decompress(self, c: Compressed, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `c` stands for, in `dtype` (default: the one it was compressed from)."""
        ...

    def compress_into(self, x: torch.Tensor, cfg: QuantConfig, buf: torch.Tensor, segments: int = 1,
                      skip: int | None = None, own_out: torch.Tensor | None = None) -> None:
        """x split into `segments` equal chunks along dim 0, chunk q packed at q * packed_stride(chunk)
        (one message: the whole buffer); chunk `skip` is not compressed (its segment is left as is).
        `own_out` (one message): also decompress(the message) written there (an all-gather's own part)."""
        ...

    def gather_into(self, cs: list[Compressed], out: torch.Tensor, barrier: FusedBarrier | None = None,
                    skip: int | None = None) -> None:
        """out[p] = decompress(cs[p]) for p != skip (out: (len(cs), *shape), contiguous).
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


class PerMessageCodec(ABC):
    """A codec from single-message compress / decompress / accumulate: the collectives' steps one
    launch per message, summed through an FP32 accumulator in memory."""

    fuses_barriers = False

    @abstractmethod
    def compress(self, x: torch.Tensor, cfg: QuantConfig) -> Compressed: ...

    @abstractmethod
    def decompress(self, c: Compressed, dtype: torch.dtype | None = None) -> torch.Tensor: ...

    @abstractmethod
    def compress_one(self, x: torch.Tensor, cfg: QuantConfig, buf: torch.Tensor) -> None:
        """x packed into buf (exactly its wire bytes)."""

    @abstractmethod
    def decompress_one(self, c: Compressed, out: torch.Tensor) -> None:
        """out = decompress(c) in out's dtype."""

    @abstractmethod
    def accumulate_one(self, c: Compressed, acc: torch.Tensor) -> None:
        """acc (FP32) += decompress(c) in FP32."""

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


class TritonCodec(PerMessageCodec):
    """The fused Triton kernels (`kernels.py`, bit for bit the reference); needs triton."""

    def __init__(self) -> None:
        from commweave.taco import kernels

        self._k = kernels

    def compress(self, x: torch.Tensor, cfg: QuantConfig) -> Compressed:
        return self._k.compress(x, cfg)

    def decompress(self, c: Compressed, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._k.decompress(c, dtype)

    def compress_one(self, x: torch.Tensor, cfg: QuantConfig, buf: torch.Tensor) -> None:
        self._k.compress_into(x, cfg, buf)

    def decompress_one(self, c: Compressed, out: torch.Tensor) -> None:
        self._k.decompress_into(c, out)

    def accumulate_one(self, c: Compressed, acc: torch.Tensor) -> None:
        self._k.decompress_accumulate(c, acc)


class CudaCodec:
    """The CUDA kernels (`cuda.py`, bit for bit the reference): one launch compresses every chunk,
    one reads every rank's message (gathering, or summing in FP32 and casting once), with
    `fuse_barriers` performing the barrier before it itself (else the collectives queue one)."""

    def __init__(self, fuse_barriers: bool = False) -> None:
        from commweave.taco import cuda

        self._k = cuda
        self.fuses_barriers = fuse_barriers

    def compress(self, x: torch.Tensor, cfg: QuantConfig) -> Compressed:
        return self._k.compress(x, cfg)

    def decompress(self, c: Compressed, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._k.decompress(c, dtype)

    def compress_into(self, x: torch.Tensor, cfg: QuantConfig, buf: torch.Tensor, segments: int = 1,
                      skip: int | None = None, own_out: torch.Tensor | None = None) -> None:
        self._k.compress_into(x, cfg, buf, segments, skip, own_out=own_out)

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
