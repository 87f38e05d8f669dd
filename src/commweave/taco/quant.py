"""FP8 group quantization with an optional Hadamard transform and dual scales (torch reference).

A tensor is flattened and cut into groups of G contiguous elements (G a power of two, 32..512).
Per group, with every option on (the TACO scheme):

    s1 = rms(x)                      pre-scale (FP32): the group to unit RMS
    y  = H (x * (1/s1))              orthonormal fast Walsh-Hadamard transform, spreads outliers
    s2 = absmax(y) / FP8_MAX         post-scale (FP32): the group's largest value to the FP8 maximum
    q  = fp8(y * (1/s2))             payload, float8_e4m3fn or float8_e5m2

and decompression is x ~= s1 * H(s2 * q) (H is symmetric and orthonormal: its own inverse).
Each scale is applied as a multiplication by its correctly rounded reciprocal (one division per
group, none per element: the fused kernels' compress is bound by arithmetic, and a per-element
IEEE division costs several instructions; the quotient differs by at most an ulp before the FP8
rounding). Scales are floored at FP32's smallest normal, so every reciprocal is finite.

Options: `wire.QuantConfig` (each switchable, so its value can be measured: bench/taco_error_table.py).

Sizes that are not a multiple of G: with pad=True (default) the flattened tensor is padded with
zeros to the next multiple of G (the padding is part of the payload and dropped on decompress);
with pad=False a ValueError is raised. Zero groups get scales of 1 (payload zeros), so zeros,
constants, FP32 subnormals and huge finite outliers never produce NaN or Inf: with dual scales for
every finite FP32 input; with a single scale and the transform on, for |x| <= FP32_MAX / G
(about 6.6e35 at G=512: the transform sees the raw values). Non-finite inputs are not supported
(they propagate).

Sums (the RMS's sum of squares, the adaptive mode's L2 errors) are pairwise in a fixed order
(`_pairwise_sum`: halves added, log2(G) times), not torch's unspecified reduction order, and the
RMS's square root is correctly rounded (`_sqrt_rn`), so that the fused Triton kernels
(`kernels.py`) can reproduce every bit of this reference.

Works on CPU and on CUDA tensors alike (pure torch). This is also `ReferenceCodec`, the reference
implementation of the `codec.Codec` interface; `compress(..., impl="triton" | "cuda")` and
`decompress(..., impl=...)` run the same through the Triton or CUDA kernels (`get_codec`), which
give these bits.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from commweave.taco.codec import Codec, CudaCodec, Impl, PerMessageCodec, TritonCodec
from commweave.taco.wire import (FP8_DTYPES, FP8_MAX, TRANSFORM_INPUT_DTYPES, Compressed, QuantConfig, pack,
                                 packed_view, unpack)

__all__ = ["FP8_DTYPES", "FP8_MAX", "TRANSFORM_INPUT_DTYPES", "Codec", "Compressed", "Impl", "QuantConfig",
           "ReferenceCodec", "compress", "decompress", "fwht", "get_codec", "pack", "packed_view", "plain_fp8_cast",
           "roundtrip", "unpack"]

_TINY = torch.finfo(torch.float32).smallest_normal


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform over the last dimension (a power of two).

    Sylvester ordering: log2(n) unscaled butterfly stages (a + b, a - b), then one multiplication
    by 1/sqrt(n) (rounded to x's dtype): orthogonal, symmetric, hence its own inverse. One scaling
    instead of one per stage: half the arithmetic of the fused kernels' transform, which bounds
    their compression. Intermediates grow by up to n, so FP32 inputs up to FP32_MAX / n cannot
    overflow."""
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"the last dimension must be a power of two, got {n}")
    lead = x.shape[:-1]
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y * (1.0 / math.sqrt(n))).reshape(*lead, n)


def _saturating_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float32:
        return x
    big = torch.finfo(dtype).max
    return x.clamp(-big, big).to(dtype).float()


def _groups(x: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
    flat = x.detach().reshape(-1).float()
    groups = cfg.num_groups(flat.numel())
    pad = groups * cfg.group_size - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(groups, cfg.group_size)


def _pairwise_sum(t: torch.Tensor) -> torch.Tensor:
    """Row sums of a (rows, 2^k) tensor in a fixed order (first half + second half, repeated), the
    order the Triton kernels use, so both give the same bits."""
    while t.shape[1] > 1:
        half = t.shape[1] // 2
        t = t[:, :half] + t[:, half:]
    return t[:, 0]


def _sqrt_rn(m: torch.Tensor) -> torch.Tensor:
    """Correctly rounded FP32 square root of non-negative FP32 `m`. torch's own sqrt is not on CPU
    (torch 2.13: ~20 % of FP32 results 1 ulp off), and the kernels' sqrt_rn is: a FP64 estimate
    rounded to FP32 is within an ulp; it moves to the neighbour whose rounding interval holds m
    (the squares of FP32 midpoints, 25-bit numbers, are exact in FP64)."""
    md = m.double()
    r = md.sqrt().float()
    up = torch.nextafter(r, torch.full_like(r, math.inf))
    down = torch.nextafter(r, torch.zeros_like(r))
    hi = (r.double() + up.double()) / 2
    lo = (r.double() + down.double()) / 2
    r = torch.where(hi * hi < md, up, r)
    return torch.where(lo * lo > md, down, r)


def _div_rn(a: torch.Tensor, divisor: float) -> torch.Tensor:
    """`a / divisor`, IEEE round-to-nearest on every device. On CUDA, torch divides by a Python
    number as a multiplication by its reciprocal (not always the correctly rounded quotient the
    kernels' `div_rn` gives); a divisor tensor on `a`'s device takes the true division."""
    return a / a.new_tensor(divisor)


def _reciprocal(s: torch.Tensor) -> torch.Tensor:
    """1 / s, correctly rounded (a tensor divisor: the true division on every device)."""
    return torch.ones_like(s) / s


def _rms(g: torch.Tensor) -> torch.Tensor:
    """Per-row RMS without overflow (|x| up to FP32 max) or underflow to zero for nonzero rows,
    floored at the smallest normal (so its reciprocal is finite); 1 for zero rows."""
    absmax = g.abs().amax(dim=1)
    safe = torch.where(absmax > 0, absmax.clamp_min(_TINY), torch.ones_like(absmax))
    rms = safe * _sqrt_rn(_div_rn(_pairwise_sum((g * _reciprocal(safe)[:, None]).square()), g.shape[1]))
    # a row of tiny subnormals can round its RMS to zero: fall back to its (floored) absmax
    return torch.where(rms > 0, rms.clamp_min(_TINY), safe)


def compress(x: torch.Tensor, cfg: QuantConfig | None = None, impl: Impl = "reference") -> Compressed:
    """Compress `x` (any shape, floating point) to FP8 groups with their scales, by codec `impl`
    (every codec gives the reference's bits)."""
    return get_codec(impl).compress(x, cfg or QuantConfig())


def _compress(x: torch.Tensor, cfg: QuantConfig) -> Compressed:
    if not x.is_floating_point():
        raise TypeError(f"compress needs a floating-point tensor, got {x.dtype}")
    g = _groups(x, cfg)
    pre = None
    if cfg.dual_scale:
        pre = _rms(g)
        g = g * _reciprocal(pre)[:, None]
    if cfg.hadamard == "adaptive":
        q_t, s_t = _quantize(fwht(_saturating_cast(g, cfg.transform_input_dtype)), cfg)
        q_p, s_p = _quantize(g, cfg)
        err_t = _pairwise_sum((fwht(q_t.float() * s_t[:, None]) - g).square())
        err_p = _pairwise_sum((q_p.float() * s_p[:, None] - g).square())
        use_t = err_t < err_p
        q = torch.where(use_t[:, None], q_t.view(torch.uint8), q_p.view(torch.uint8)).view(cfg.fp8_dtype)
        return Compressed(q, torch.where(use_t, -s_t, s_p), pre, x.shape, x.dtype, cfg)
    if cfg.hadamard:
        g = fwht(_saturating_cast(g, cfg.transform_input_dtype))
    q, scale = _quantize(g, cfg)
    return Compressed(q, scale, pre, x.shape, x.dtype, cfg)


def _quantize(g: torch.Tensor, cfg: QuantConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row absmax scale to the FP8 maximum, and the FP8 rows."""
    absmax = g.abs().amax(dim=1)
    scale = _div_rn(absmax, cfg.fp8_max)
    # zero groups: scale 1; groups so small that absmax/FP8_MAX underflows: the smallest normal
    scale = torch.where(absmax > 0, scale.clamp_min(_TINY), torch.ones_like(scale))
    q = (g * _reciprocal(scale)[:, None]).clamp(-cfg.fp8_max, cfg.fp8_max).to(cfg.fp8_dtype)
    return q, scale


def decompress(c: Compressed, dtype: torch.dtype | None = None, impl: Impl = "reference") -> torch.Tensor:
    """The tensor `c` stands for, in `dtype` (default: the dtype it was compressed from), by codec `impl`."""
    return get_codec(impl).decompress(c, dtype)


def _decompress(c: Compressed, dtype: torch.dtype | None = None) -> torch.Tensor:
    if c.config.hadamard == "adaptive":  # a negative scale marks a transformed group
        g = c.payload.float() * c.scale.abs()[:, None]
        transformed = c.scale < 0
        g[transformed] = fwht(g[transformed])
    else:
        g = c.payload.float() * c.scale[:, None]
        if c.config.hadamard:
            g = fwht(g)
    if c.pre_scale is not None:
        g = g * c.pre_scale[:, None]
    out = g.reshape(-1)[: c.numel].view(c.shape)
    return out.to(dtype or c.dtype)


def roundtrip(x: torch.Tensor, cfg: QuantConfig | None = None) -> torch.Tensor:
    return decompress(compress(x, cfg))


def plain_fp8_cast(x: torch.Tensor, fmt: str = "e4m3", per_tensor_scale: bool = True) -> torch.Tensor:
    """The baseline: cast the whole tensor to FP8 with one absmax scale (or none) and back."""
    dtype, top = FP8_DTYPES[fmt], FP8_MAX[fmt]
    xf = x.detach().float()
    scale = torch.tensor(1.0)
    if per_tensor_scale:
        absmax = xf.abs().max()
        scale = torch.where(absmax > 0, absmax / top, torch.ones_like(absmax)).clamp_min(torch.finfo(torch.float32).smallest_normal)
    q = (xf / scale).clamp(-top, top).to(dtype)
    return (q.float() * scale).to(x.dtype)


class ReferenceCodec(PerMessageCodec):
    """This module's compress/decompress as a codec (torch, any device): the reference bits."""

    def compress(self, x: torch.Tensor, cfg: QuantConfig) -> Compressed:
        return _compress(x, cfg)

    def decompress(self, c: Compressed, dtype: torch.dtype | None = None) -> torch.Tensor:
        return _decompress(c, dtype)

    def compress_one(self, x: torch.Tensor, cfg: QuantConfig, buf: torch.Tensor) -> None:
        buf.copy_(pack(_compress(x, cfg)))

    def decompress_one(self, c: Compressed, out: torch.Tensor) -> None:
        out.copy_(_decompress(c, out.dtype).view(out.shape))

    def accumulate_one(self, c: Compressed, acc: torch.Tensor) -> None:
        acc.add_(_decompress(c, torch.float32).view(acc.shape))  # = collectives._sum_fp32's `total + d`


CODECS: dict[str, Callable[[], Codec]] = {"reference": ReferenceCodec, "triton": TritonCodec, "cuda": CudaCodec}
_made: dict[str, Codec] = {}


def get_codec(impl: Impl = "reference") -> Codec:
    """The codec named `impl`, made once per process (the kernels' modules are imported then)."""
    if impl not in CODECS:
        *first, last = map(repr, CODECS)
        raise ValueError(f"impl must be {', '.join(first)} or {last}, got {impl!r}")
    if impl not in _made:
        _made[impl] = CODECS[impl]()
    return _made[impl]
