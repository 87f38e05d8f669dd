"""The machine and format facts every layer reads: one definition each.

`HardwareProfile` holds what the cost model, the floor, the timer and the templates assume about a
GPU before anything is measured (`evaluate.floor.calibrate` replaces the rates with measured ones);
`H200` is the default, read off the lent machine (shared/reference/DEVICE.md). The FP8 format facts
(group sizes the codecs implement, each format's expected error) are shared by the design space's
validity rules, the templates and the TACO quantizer, so a set `validate()` admits is one the
kernels take.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU model's facts: SMs, L2, and the rates a memory-, link- or matrix-bound program meets."""

    name: str
    sms: int  # streaming multiprocessors
    l2_bytes: int  # last-level cache: rotating inputs past twice this never hit it
    matmul_flops_per_s: float  # bf16 cuBLAS, 8192^3, random data
    link_bytes_per_s: float  # peer copy GPU0 -> GPU1 over NVLink (copy engine)
    hbm_bytes_per_s: float  # device-to-device copy, reads + writes counted
    #: the fraction of the copy-engine link rate that SM stores into a peer's window reached (LSA)
    sm_store_share: float


H200 = HardwareProfile(name="NVIDIA H200", sms=132, l2_bytes=50 << 20, matmul_flops_per_s=790e12,
                       link_bytes_per_s=394e9, hbm_bytes_per_s=4.0e12, sm_store_share=0.66)

#: FP8 group quantization: the group sizes (values sharing one scale) the codecs implement
MIN_GROUP, MAX_GROUP = 32, 512
GROUP_SIZES: tuple[int, ...] = tuple(1 << i for i in range(MIN_GROUP.bit_length() - 1, MAX_GROUP.bit_length()))

#: expected relative error of each FP8 format (half an ulp of its mantissa, uniform rounding): a
#: tolerance admits a format only when it is at least this
COMPRESSION_ERROR: dict[str, float] = {"fp8_e4m3": 2.0 ** -4 / 3 ** 0.5, "fp8_e5m2": 2.0 ** -3 / 3 ** 0.5}
