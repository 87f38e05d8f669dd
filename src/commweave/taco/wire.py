"""What travels: how a tensor is compressed (`QuantConfig`), the compressed message (`Compressed`),
and its bytes (`pack` / `packed_view` / `unpack`: payload, FP32 post-scales, FP32 pre-scales back
to back in one uint8 buffer, the layout a symmetric window holds).

Below every codec (the reference in `quant`, the Triton and CUDA kernels) so that each of them
imports this and none imports another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

from commweave.contracts.profile import MAX_GROUP, MIN_GROUP

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {name: float(torch.finfo(dtype).max) for name, dtype in FP8_DTYPES.items()}
TRANSFORM_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class QuantConfig:
    """How a tensor is compressed (quant.py's scheme); every switch is independent.

    group_size   G, a power of two in 32..512
    fmt          'e4m3' (max 448, 3 mantissa bits) or 'e5m2' (max 57344, 2 mantissa bits)
    hadamard     True, False (no transform), or "adaptive": per group, whichever of transform / none
                 quantizes it with the lower L2 error, the choice in the post-scale's sign (negative:
                 transformed; no extra bytes). Ours, not the paper's: with FP8 floating-point
                 payloads the transform hurts groups that hold outliers (NOTES.md, error table).
    dual_scale   False: one absmax scale per group after the transform (no RMS pre-scale stored)
    pad          True: sizes that are not a multiple of G are zero-padded; False: refused
    transform_input_dtype  the dtype the transform's input is rounded to (saturating): 16-bit
                 emulates a tensor-core Hadamard, where the pre-scale keeps groups out of FP16's
                 subnormals and overflow (in exact FP32 the two scales multiply to the single one)
    """

    group_size: int = 128
    fmt: str = "e4m3"
    hadamard: bool | str = True  # True, False or "adaptive"
    dual_scale: bool = True
    pad: bool = True
    transform_input_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        g = self.group_size
        if not isinstance(g, int) or isinstance(g, bool) or g < MIN_GROUP or g > MAX_GROUP or g & (g - 1):
            raise ValueError(f"group_size must be a power of two in {MIN_GROUP}..{MAX_GROUP}, got {g!r}")
        if not (isinstance(self.hadamard, bool) or self.hadamard == "adaptive"):
            raise ValueError(f"hadamard must be True, False or 'adaptive', got {self.hadamard!r}")
        if self.fmt not in FP8_DTYPES:
            raise ValueError(f"fmt must be one of {sorted(FP8_DTYPES)}, got {self.fmt!r}")
        if self.transform_input_dtype not in TRANSFORM_INPUT_DTYPES:
            raise ValueError(f"transform_input_dtype must be one of {TRANSFORM_INPUT_DTYPES}, got {self.transform_input_dtype}")
        object.__setattr__(self, "_hash", hash(self._fields()))

    def _fields(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self))

    def __hash__(self) -> int:
        """Computed once: a config keys the collectives' buffers and kernels, ~10 lookups a call."""
        return self._hash

    def __reduce__(self) -> tuple:
        """Pickled as its fields: the cached hash (of a dtype, a str) is only valid in this process."""
        return type(self), self._fields()

    @property
    def fp8_dtype(self) -> torch.dtype:
        return FP8_DTYPES[self.fmt]

    @property
    def fp8_max(self) -> float:
        return FP8_MAX[self.fmt]

    @property
    def scales_per_group(self) -> int:
        return 2 if self.dual_scale else 1

    def num_groups(self, numel: int) -> int:
        if numel % self.group_size and not self.pad:
            raise ValueError(f"{numel} elements are not a multiple of group_size={self.group_size} and pad=False")
        return -(-numel // self.group_size)

    def wire_bytes(self, numel: int) -> int:
        """Bytes on the wire for `numel` elements: FP8 payload (padded) plus FP32 scales."""
        groups = self.num_groups(numel)
        return groups * self.group_size + 4 * self.scales_per_group * groups

    def packed_stride(self, numel: int) -> int:
        """Bytes from one packed message of `numel` elements to the next in a buffer holding several
        (a reduce-scatter's chunks): wire bytes rounded up to 16, the CUDA kernels' access alignment."""
        return -(-self.wire_bytes(numel) // 16) * 16


@dataclass
class Compressed:
    """A compressed tensor: FP8 payload (groups, G), FP32 scales (groups,), original shape/dtype."""

    payload: torch.Tensor
    scale: torch.Tensor  # post-transform absmax scale (the only one when dual_scale=False)
    pre_scale: torch.Tensor | None  # RMS pre-scale, None when dual_scale=False
    shape: torch.Size
    dtype: torch.dtype
    config: QuantConfig
    # (payload, scale, pre_scale, config, address) once the CUDA kernels checked that the tensors are
    # one packed message at `address` (cuda._packed_address): done once per cached view, not per call
    packed_check: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def num_groups(self) -> int:
        return self.payload.shape[0]

    @property
    def nbytes(self) -> int:
        extra = 0 if self.pre_scale is None else self.pre_scale.numel() * 4
        return self.payload.numel() + self.scale.numel() * 4 + extra


def pack(c: Compressed) -> torch.Tensor:
    """payload bytes, then FP32 scale, then FP32 pre-scale (if any), as one uint8 tensor."""
    parts = [c.payload.reshape(-1).view(torch.uint8), c.scale.contiguous().view(torch.uint8)]
    if c.pre_scale is not None:
        parts.append(c.pre_scale.contiguous().view(torch.uint8))
    return torch.cat(parts)


def packed_view(buf: torch.Tensor, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, cfg: QuantConfig) -> Compressed:
    """A Compressed whose tensors are views of a packed buffer, no copy (for a peer's window, a
    copy of the scales would be an extra NVLink round trip)."""
    shape = torch.Size(shape)
    numel = math.prod(shape)
    groups = cfg.num_groups(numel)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != cfg.wire_bytes(numel):
        raise ValueError(f"buffer of {buf.numel()} {buf.dtype} does not hold {tuple(shape)} under {cfg}")
    n_payload = groups * cfg.group_size  # a multiple of 32: the scales stay 4-byte aligned
    payload = buf[:n_payload].view(cfg.fp8_dtype).view(groups, cfg.group_size)
    scale = buf[n_payload:n_payload + 4 * groups].view(torch.float32)
    pre = buf[n_payload + 4 * groups:].view(torch.float32) if cfg.dual_scale else None
    return Compressed(payload, scale, pre, shape, dtype, cfg)


def unpack(buf: torch.Tensor, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, cfg: QuantConfig) -> Compressed:
    """Inverse of pack() for a tensor of `shape`/`dtype` compressed with `cfg`: a copy of the buffer
    (which may sit at any byte offset, e.g. a slice of a received batch), viewed as packed_view does."""
    return packed_view(buf.clone(), shape, dtype, cfg)
