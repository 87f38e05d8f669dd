"""Fused Triton kernels for TACO's quantizer: compress, decompress, decompress-and-accumulate.

One program handles ROWS groups of G contiguous elements (a [ROWS, G] FP32 tile in registers) and
does in one pass what `quant.compress` does in several: load (any of FP32/FP16/BF16, zero padding
past the end by masking), RMS pre-scale, optional 16-bit rounding of the transform's input,
orthonormal fast Walsh-Hadamard transform as log2(G) butterfly stages (reshape/permute/split/join
of the tile: the same additions in the same order as `quant.fwht`, then its one scaling), absmax post-scale, FP8 cast;
`hadamard="adaptive"` quantizes both ways, dequantizes both and keeps the lower-L2 one per group.
Decompression is the inverse; `decompress_accumulate` adds into an FP32 accumulator instead of
writing (what the compressed reduce-scatter / all-reduce need for their FP32 sums).

Bit-exact with the torch reference (`quant.py`), by construction and checked by the tests:
  * every division (the per-group reciprocals of the scales, and the RMS's mean) and square root is
    IEEE round-to-nearest (`div_rn`, `sqrt_rn`; Triton's plain
    `/` and `sqrt` are approximate on NVIDIA GPUs; the reference's sqrt is corrected to be exact,
    `quant._sqrt_rn`, since torch's CPU sqrt is not);
  * sums are pairwise in the reference's order (`quant._pairwise_sum`), maxima are exact;
  * kernels are launched with `enable_fp_fusion=False`: the butterfly's `(a + b) * c` feeding the
    next stage's addition would otherwise be contracted into FMAs and round differently (the sm_90
    PTX then has add.rn / mul.rn and no fma, no .ftz: a CPU test compiles it and checks);
  * FP8 and 16-bit casts round to nearest even after the same clamp as the reference: on CUDA the
    hardware's cvt.rn(.satfinite); with `round_in_fp32` (the default under the interpreter, whose
    FP8/BF16 casts round half up and lose the carry into the exponent in Triton 3.6) the value is
    first rounded onto the target grid in FP32 arithmetic (`_round_to_format`), so the cast is exact.
So payload bytes, scales and decompressed values equal the reference's bit for bit, for every
QuantConfig (every format, G, hadamard True/False/"adaptive", dual_scale, transform_input_dtype,
pad): nothing is rejected. One exception, by IEEE semantics: `decompress_accumulate` onto a zero
accumulator turns a decompressed -0.0 into +0.0 (equal values; the reference's first term keeps the
sign); start the sum with `decompress(..., torch.float32)` to keep it.

Where it runs: CUDA tensors launch the compiled kernels. CPU tensors run them in Triton's
interpreter (numpy; slow, for tests), which Triton only offers to a process that imported it with
TRITON_INTERPRET=1 (the setting is read when Triton's own library is decorated); in any other
process CPU tensors get a RuntimeError. The CPU tests therefore run in a spawned child with that
variable; what they cannot prove (compiled code's behaviour, the hardware casts, speed) is what
`pytest -m gpu tests/test_taco_kernels.py` checks on CUDA.

Inputs: FP32, FP16 or BF16 (others are refused: convert first); outputs of decompress: the same
three. Wire layout: `compress_into` writes `quant.pack`'s layout (payload bytes, FP32 post-scales,
FP32 pre-scales) straight into a uint8 buffer, e.g. a symmetric window; `compress` returns a
`Compressed` whose tensors are views of such a buffer.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from commweave.runtime.launch import on_device
from commweave.taco.wire import Compressed, QuantConfig, packed_view

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_HADAMARD_CODE = {False: 0, True: 1, "adaptive": 2}
_CAST_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_TILE_ELEMENTS = {"cuda": 2048, "cpu": 1 << 16}  # elements per program: registers on GPU, numpy calls on CPU
_TINY = torch.finfo(torch.float32).smallest_normal
# (mantissa bits, smallest normal exponent) of each format a kernel rounds to
_FORMATS = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14), torch.float16: (10, -14),
            torch.bfloat16: (7, -126), torch.float32: (23, -126)}


def _format_args(dtype: torch.dtype, prefix: str) -> dict[str, float | int]:
    """Constexprs for _round_to_format: MANT, EMIN and MAGIC = 1.5 * 2^(23 + EMIN - MANT)."""
    mant, emin = _FORMATS[dtype]
    return {f"{prefix}_MANT": mant, f"{prefix}_EMIN": emin, f"{prefix}_MAGIC": math.ldexp(1.5, 23 + emin - mant)}


# -- device code: helpers are @triton.jit, inlined into the kernels ------------------------------

@triton.jit
def _fwht_rows(y, ROWS: tl.constexpr, G: tl.constexpr, LOG_G: tl.constexpr, FWHT_SCALE: tl.constexpr):
    """quant.fwht on each row of a [ROWS, G] FP32 tile: stage h pairs element i with i + h, unscaled;
    then one multiplication by 1/sqrt(G)."""
    for s in tl.static_range(LOG_G):
        t = tl.permute(tl.reshape(y, (ROWS, G >> (s + 1), 2, 1 << s)), (0, 1, 3, 2))  # pairs (i, i + 2^s)
        a, b = tl.split(t)
        t = tl.join(a + b, a - b)
        y = tl.reshape(tl.permute(t, (0, 1, 3, 2)), (ROWS, G))
    return y * FWHT_SCALE


@triton.jit
def _pairwise_sum_rows(v, ROWS: tl.constexpr, G: tl.constexpr, LOG_G: tl.constexpr):
    """quant._pairwise_sum: first half + second half, log2(G) times."""
    for s in tl.static_range(LOG_G):
        a, b = tl.split(tl.permute(tl.reshape(v, (ROWS, 2, G >> (s + 1))), (0, 2, 1)))
        v = a + b
    return tl.reshape(v, (ROWS,))


@triton.jit
def _reciprocal(s):
    """quant._reciprocal: 1 / s, correctly rounded."""
    return tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)


@triton.jit
def _round_to_format(v, MANT: tl.constexpr, EMIN: tl.constexpr, MAGIC: tl.constexpr):
    """FP32 `v` rounded to nearest even onto the grid of a float format with MANT mantissa bits and
    smallest normal exponent EMIN (its subnormals included), still as FP32: the cast that follows is
    then exact. Used under the interpreter, whose FP8/BF16 casts round half up and drop the carry
    into the exponent (Triton 3.6). FP8 callers clamp to the maximum first; for FP16/BF16 a value
    that rounds past the maximum comes out past it (BF16: inf), and the cast makes it inf as torch's
    does.
    Target-normal values: integer round-to-nearest-even on the FP32 bits (a carry may bump the
    exponent, which is right). Target-subnormal ones: (|v| + MAGIC) - MAGIC, MAGIC = 1.5 * 2^(23 +
    EMIN - MANT), whose ulp is the subnormal spacing. The sign is put back last (-0 stays -0)."""
    SHIFT: tl.constexpr = 23 - MANT
    KEEP: tl.constexpr = (0xFFFFFFFF >> SHIFT) << SHIFT
    HALF: tl.constexpr = (1 << (SHIFT - 1)) - 1
    bits = v.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag = bits & 0x7FFFFFFF
    normal = (mag + HALF + ((mag >> SHIFT) & 1)) & KEEP
    tiny = ((mag.to(tl.float32, bitcast=True) + MAGIC) - MAGIC).to(tl.uint32, bitcast=True)
    exponent = (mag >> 23).to(tl.int32) - 127
    return (tl.where(exponent >= EMIN, normal, tiny) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_rows(y, FP8_MAX: tl.constexpr, TINY: tl.constexpr, FP8: tl.constexpr, ROUND: tl.constexpr,
                   MANT: tl.constexpr, EMIN: tl.constexpr, MAGIC: tl.constexpr):
    """quant._quantize: per-row absmax scale to the FP8 maximum, FP8 payload."""
    absmax = tl.max(tl.abs(y), axis=1)
    scale = tl.where(absmax > 0, tl.maximum(tl.math.div_rn(absmax, FP8_MAX), TINY), 1.0)
    q = tl.minimum(tl.maximum(y * _reciprocal(scale)[:, None], -FP8_MAX), FP8_MAX)
    if ROUND:
        q = _round_to_format(q, MANT, EMIN, MAGIC)
    return q.to(FP8), scale


@triton.jit
def _cast_round_trip(v, DTYPE: tl.constexpr, ROUND: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr,
                     MAGIC: tl.constexpr):
    """v rounded to a 16-bit float DTYPE and back to FP32 (quant._saturating_cast after its clamp).
    With ROUND the FP32 rounding is the whole round trip (the casts would be exact)."""
    if ROUND:
        return _round_to_format(v, MANT, EMIN, MAGIC)
    return v.to(DTYPE).to(tl.float32)


@triton.jit
def _compress_kernel(x_ptr, q_ptr, scale_ptr, pre_ptr, numel, n_groups,
                     G: tl.constexpr, LOG_G: tl.constexpr, FWHT_SCALE: tl.constexpr, ROWS: tl.constexpr, FP8_MAX: tl.constexpr,
                     TINY: tl.constexpr, DUAL: tl.constexpr, HADAMARD: tl.constexpr, CAST: tl.constexpr,
                     CAST_MAX: tl.constexpr, ROUND: tl.constexpr, Q_MANT: tl.constexpr, Q_EMIN: tl.constexpr,
                     Q_MAGIC: tl.constexpr, C_MANT: tl.constexpr, C_EMIN: tl.constexpr, C_MAGIC: tl.constexpr,
                     IN_BF16: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * G + tl.arange(0, G)[None, :]
    row_ok = rows < n_groups
    if IN_BF16:  # BF16 -> FP32 by its bits: exact, where the interpreter's cast mangles BF16 subnormals
        raw = tl.load(x_ptr.to(tl.pointer_type(tl.uint16)) + offs, mask=offs < numel, other=0)
        g = (raw.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        g = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
    if DUAL:  # quant._rms
        absmax = tl.max(tl.abs(g), axis=1)
        safe = tl.where(absmax > 0, tl.maximum(absmax, TINY), 1.0)
        t = g * _reciprocal(safe)[:, None]
        rms = safe * tl.sqrt_rn(tl.math.div_rn(_pairwise_sum_rows(t * t, ROWS, G, LOG_G), G * 1.0))
        pre = tl.where(rms > 0, tl.maximum(rms, TINY), safe)
        g = g * _reciprocal(pre)[:, None]
        tl.store(pre_ptr + rows, pre, mask=row_ok)
    FP8: tl.constexpr = q_ptr.dtype.element_ty
    if HADAMARD == 0:
        q, scale = _quantize_rows(g, FP8_MAX, TINY, FP8, ROUND, Q_MANT, Q_EMIN, Q_MAGIC)
    else:
        h_in = g
        if CAST == 1:  # quant._saturating_cast
            h_in = _cast_round_trip(tl.minimum(tl.maximum(g, -CAST_MAX), CAST_MAX), tl.float16, ROUND, C_MANT,
                                    C_EMIN, C_MAGIC)
        if CAST == 2:
            h_in = _cast_round_trip(tl.minimum(tl.maximum(g, -CAST_MAX), CAST_MAX), tl.bfloat16, ROUND, C_MANT,
                                    C_EMIN, C_MAGIC)
        q, scale = _quantize_rows(_fwht_rows(h_in, ROWS, G, LOG_G, FWHT_SCALE), FP8_MAX, TINY, FP8, ROUND, Q_MANT, Q_EMIN,
                                  Q_MAGIC)
        if HADAMARD == 2:  # per group the lower L2 error of transformed / plain; flag: negative scale
            q_p, s_p = _quantize_rows(g, FP8_MAX, TINY, FP8, ROUND, Q_MANT, Q_EMIN, Q_MAGIC)
            d_t = _fwht_rows(q.to(tl.float32) * scale[:, None], ROWS, G, LOG_G, FWHT_SCALE) - g
            d_p = q_p.to(tl.float32) * s_p[:, None] - g
            use_t = _pairwise_sum_rows(d_t * d_t, ROWS, G, LOG_G) < _pairwise_sum_rows(d_p * d_p, ROWS, G, LOG_G)
            q = tl.where(use_t[:, None], q, q_p)
            scale = tl.where(use_t, -scale, s_p)
    tl.store(q_ptr + offs, q, mask=row_ok[:, None])
    tl.store(scale_ptr + rows, scale, mask=row_ok)


@triton.jit
def _decompress_kernel(q_ptr, scale_ptr, pre_ptr, out_ptr, numel, n_groups,
                       G: tl.constexpr, LOG_G: tl.constexpr, FWHT_SCALE: tl.constexpr, ROWS: tl.constexpr, DUAL: tl.constexpr,
                       HADAMARD: tl.constexpr, ACCUMULATE: tl.constexpr, ROUND: tl.constexpr,
                       O_MANT: tl.constexpr, O_EMIN: tl.constexpr, O_MAGIC: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * G + tl.arange(0, G)[None, :]
    row_ok = rows < n_groups
    q = tl.load(q_ptr + offs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + rows, mask=row_ok, other=1.0)
    if HADAMARD == 2:  # quant.decompress: a negative scale marks a transformed group
        g = q * tl.abs(scale)[:, None]
        g = tl.where((scale < 0)[:, None], _fwht_rows(g, ROWS, G, LOG_G, FWHT_SCALE), g)
    elif HADAMARD == 1:
        g = _fwht_rows(q * scale[:, None], ROWS, G, LOG_G, FWHT_SCALE)
    else:
        g = q * scale[:, None]
    if DUAL:
        g = g * tl.load(pre_ptr + rows, mask=row_ok, other=1.0)[:, None]
    keep = offs < numel
    if ACCUMULATE:
        tl.store(out_ptr + offs, tl.load(out_ptr + offs, mask=keep, other=0.0) + g, mask=keep)
    else:
        if ROUND and O_MANT == 7:  # BF16 by its bits (the interpreter's cast mangles subnormals)
            bits = _round_to_format(g, O_MANT, O_EMIN, O_MAGIC).to(tl.uint32, bitcast=True)
            tl.store(out_ptr.to(tl.pointer_type(tl.uint16)) + offs, (bits >> 16).to(tl.uint16), mask=keep)
        else:
            if ROUND and O_MANT < 23:
                g = _round_to_format(g, O_MANT, O_EMIN, O_MAGIC)
            tl.store(out_ptr + offs, g.to(out_ptr.dtype.element_ty), mask=keep)


# -- host side ---------------------------------------------------------------------------------

def _check_device(device: torch.device) -> None:
    """CUDA tensors run compiled kernels; CPU tensors only in a process whose Triton was imported with
    TRITON_INTERPRET=1 (the interpreter; Triton decides at import, for its own library too)."""
    if device.type == "cuda":
        return
    if device.type == "cpu":
        if isinstance(_compress_kernel, InterpretedFunction):
            return
        raise RuntimeError("the Triton kernels got CPU tensors but Triton is not in interpreter mode: set "
                           "TRITON_INTERPRET=1 before anything imports triton, or use impl='reference'")
    raise ValueError(f"the Triton kernels run on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), got {device}")


def _rows(cfg: QuantConfig, n_groups: int, device: torch.device) -> int:
    per_tile = max(1, _TILE_ELEMENTS.get(device.type, 2048) // cfg.group_size)
    return max(1, min(per_tile, triton.next_power_of_2(max(1, n_groups))))


def _check_dtype(dtype: torch.dtype, what: str) -> None:
    if dtype not in KERNEL_DTYPES:
        raise TypeError(f"the Triton kernels take {what} in float32, float16 or bfloat16, got {dtype} "
                        f"(convert it first, or use impl='reference')")


def _round_in_fp32(device: torch.device, round_in_fp32: bool | None) -> bool:
    """Default: round in FP32 before the casts under the interpreter (its casts are wrong), let the
    hardware cast round on CUDA (cvt.rn.satfinite: round to nearest even, like torch)."""
    return device.type == "cpu" if round_in_fp32 is None else bool(round_in_fp32)


def compress_into(x: torch.Tensor, cfg: QuantConfig, buf: torch.Tensor, round_in_fp32: bool | None = None) -> torch.Tensor:
    """Compress `x` into `buf` (uint8, cfg.wire_bytes(x.numel()) long, e.g. a symmetric window) in
    `quant.pack`'s layout, in one kernel launch; returns `buf`. `round_in_fp32`: see _round_in_fp32
    (both settings give the reference's bits; the GPU test checks and times both)."""
    _check_device(x.device)
    _check_dtype(x.dtype, "input")
    numel = x.numel()
    n_groups = cfg.num_groups(numel)  # raises for pad=False and a ragged size
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous() or buf.numel() != cfg.wire_bytes(numel):
        raise ValueError(f"buf must be a contiguous 1-D uint8 tensor of {cfg.wire_bytes(numel)} bytes for "
                         f"{numel} elements under {cfg}, got {buf.dtype} {tuple(buf.shape)}")
    if buf.device != x.device:
        raise ValueError(f"x is on {x.device} but buf on {buf.device}")
    if n_groups == 0:
        return buf
    c = packed_view(buf, (numel,), x.dtype, cfg)
    payload, scale, pre = c.payload, c.scale, c.pre_scale
    rows = _rows(cfg, n_groups, x.device)
    cast = cfg.transform_input_dtype
    with on_device(x.device):
        _compress_kernel[(triton.cdiv(n_groups, rows),)](
            x.contiguous(), payload, scale, scale if pre is None else pre, numel, n_groups,
            G=cfg.group_size, LOG_G=cfg.group_size.bit_length() - 1, FWHT_SCALE=1.0 / math.sqrt(cfg.group_size), ROWS=rows, FP8_MAX=cfg.fp8_max, TINY=_TINY,
            DUAL=cfg.dual_scale, HADAMARD=_HADAMARD_CODE[cfg.hadamard], CAST=_CAST_CODE[cast],
            CAST_MAX=float(torch.finfo(cast).max), ROUND=_round_in_fp32(x.device, round_in_fp32),
            **_format_args(cfg.fp8_dtype, "Q"), **_format_args(cast, "C"), IN_BF16=x.dtype == torch.bfloat16,
            enable_fp_fusion=False)
    return buf


def compress(x: torch.Tensor, cfg: QuantConfig | None = None, round_in_fp32: bool | None = None) -> Compressed:
    """`quant.compress` in one fused kernel; the result's tensors are views of one packed buffer
    (so `quant.pack` of it equals that buffer)."""
    cfg = cfg or QuantConfig()
    if not x.is_floating_point():
        raise TypeError(f"compress needs a floating-point tensor, got {x.dtype}")
    buf = torch.empty(cfg.wire_bytes(x.numel()), dtype=torch.uint8, device=x.device)
    compress_into(x, cfg, buf, round_in_fp32)
    return packed_view(buf, x.shape, x.dtype, cfg)


def _launch_decompress(c: Compressed, out: torch.Tensor, accumulate: bool, round_in_fp32: bool | None) -> None:
    _check_device(out.device)
    cfg = c.config
    n_groups = c.num_groups
    if c.payload.dtype != cfg.fp8_dtype or tuple(c.payload.shape) != (n_groups, cfg.group_size):
        raise ValueError(f"payload {c.payload.dtype} {tuple(c.payload.shape)} does not match {cfg}")
    if (c.pre_scale is not None) != cfg.dual_scale:
        raise ValueError(f"pre_scale is {'present' if c.pre_scale is not None else 'missing'} but dual_scale={cfg.dual_scale}")
    if n_groups != cfg.num_groups(c.numel):
        raise ValueError(f"{n_groups} groups do not hold {c.numel} elements at G={cfg.group_size}")
    if out.device != c.payload.device:
        raise ValueError(f"the payload is on {c.payload.device} but the output on {out.device}")
    if n_groups == 0:
        return
    rows = _rows(cfg, n_groups, out.device)
    scale = c.scale.contiguous()
    pre = scale if c.pre_scale is None else c.pre_scale.contiguous()
    with on_device(out.device):
        _decompress_kernel[(triton.cdiv(n_groups, rows),)](
            c.payload.contiguous(), scale, pre, out, c.numel, n_groups,
            G=cfg.group_size, LOG_G=cfg.group_size.bit_length() - 1, FWHT_SCALE=1.0 / math.sqrt(cfg.group_size), ROWS=rows, DUAL=cfg.dual_scale,
            HADAMARD=_HADAMARD_CODE[cfg.hadamard], ACCUMULATE=accumulate,
            ROUND=_round_in_fp32(out.device, round_in_fp32), **_format_args(out.dtype, "O"),
            enable_fp_fusion=False)


def decompress(c: Compressed, dtype: torch.dtype | None = None, round_in_fp32: bool | None = None) -> torch.Tensor:
    """`quant.decompress` in one fused kernel (output FP32, FP16 or BF16)."""
    dtype = dtype or c.dtype
    _check_dtype(dtype, "output")
    out = torch.empty(c.shape, dtype=dtype, device=c.payload.device)
    _launch_decompress(c, out, False, round_in_fp32)
    return out


def decompress_into(c: Compressed, out: torch.Tensor, round_in_fp32: bool | None = None) -> torch.Tensor:
    """`decompress` written into a caller's tensor (FP32/FP16/BF16, contiguous, c's element count):
    the device collectives decompress each peer's slice straight into its place in the output."""
    _check_dtype(out.dtype, "output")
    if not out.is_contiguous() or out.numel() != c.numel:
        raise ValueError(f"out must be a contiguous tensor of {c.numel} elements, got {tuple(out.shape)}"
                         f"{'' if out.is_contiguous() else ' (not contiguous)'}")
    _launch_decompress(c, out, False, round_in_fp32)
    return out


def decompress_accumulate(c: Compressed, acc: torch.Tensor) -> torch.Tensor:
    """acc += decompress(c) in FP32, in place, in one kernel (the reduction step of the compressed
    reduce-scatter / all-reduce); returns acc. Same bits as the reference's FP32 sum."""
    if acc.dtype != torch.float32 or not acc.is_contiguous() or acc.numel() != c.numel:
        raise ValueError(f"acc must be a contiguous float32 tensor of {c.numel} elements, got "
                         f"{acc.dtype} {tuple(acc.shape)}{'' if acc.is_contiguous() else ' (not contiguous)'}")
    _launch_decompress(c, acc, True, None)
    return acc
