"""A first-order cost model of a directive set: communication vs computation time per call.

It ranks proposals before anything is measured; it is not a simulator. Rates come from
`MachineRates` (measured by `calibrate` on the machine, H200 defaults otherwise), the work from the
workload's `cost()`. Terms:

- communication: the bytes a rank receives over the achievable rate of the backend (copy engines:
  the link rate; LSA/GIN stores: grows with the CTAs and issuer width given to it, capped at the
  fraction SM stores reached in the seed's measurements), plus a per-signal latency per chunk;
  FP8 compression halves the payload (plus one scale per group) and adds a quantisation pass;
- computation: FLOPs at the matmul rate on the SMs left over by communication CTAs, plus a launch
  per piece the computation is cut into, plus with compression the codec's passes on those SMs
  (compressing the own shard, decompressing what arrives, at the HBM rate), so compression ranks
  slower where the uncompressed exchange already hides behind the computation;
- placement: deferred adds them; split/fused overlap them, except the part of the shorter one that
  cannot hide (one piece's worth).
Template knobs are not modelled: the measured database ranks them.
"""

from __future__ import annotations

import math

from commweave.contracts.profile import H200
from commweave.evaluate.floor import MachineRates
from commweave.space import DirectiveSet
from commweave.contracts.workload import Cost

PER_CTA_SHARE = 0.085  # fraction of the link rate one CTA's stores reach
ISSUER_WIDTH = {"thread": 0.5, "warp": 0.8, "cta": 1.0}
SIGNAL_S = 2e-6  # one chunk's signal + wait
LAUNCH_S = 4e-6  # one extra GEMM launch


def comm_time_s(ds: DirectiveSet, cost: Cost, world_size: int, rates: MachineRates) -> tuple[float, int]:
    """(seconds to receive this rank's bytes, number of chunks per peer shard)."""
    payload = cost.comm_bytes
    extra = 0.0
    if ds.compression != "none":
        group = max(ds.group_size, 1)
        payload = payload / 2 * (1 + 4 / group)  # bf16 -> fp8, one fp32 scale per group
        extra = 2 * cost.comm_bytes / max(world_size - 1, 1) / rates.hbm_bytes_per_s  # quantise own shard
    if ds.backend == "ce":
        bandwidth = rates.link_bytes_per_s
    else:
        bandwidth = rates.link_bytes_per_s * min(H200.sm_store_share, ds.comm_ctas * PER_CTA_SHARE * ISSUER_WIDTH[ds.issuer])
    shard = cost.comm_bytes / max(world_size - 1, 1)
    chunks = 1 if ds.sync in ("global", "peer") else max(1, math.ceil(shard / ds.chunk_bytes))
    return payload / bandwidth + extra + chunks * max(world_size - 1, 1) * SIGNAL_S, chunks


def codec_time_s(ds: DirectiveSet, cost: Cost, world_size: int, rates: MachineRates) -> float:
    """The compression's work on the SMs the computation uses: the own shard compressed (BF16 read,
    FP8 written) and what arrives decompressed (FP8 read, BF16 written), at the HBM rate."""
    def fp8(nbytes: float) -> float:
        return nbytes / 2 * (1 + 4 / max(ds.group_size, 1))

    shard = cost.comm_bytes / max(world_size - 1, 1)
    return (shard + fp8(shard) + fp8(cost.comm_bytes) + cost.comm_bytes) / rates.hbm_bytes_per_s


def predict_s(ds: DirectiveSet, cost: Cost, world_size: int, rates: MachineRates) -> float:
    """Predicted time of one call."""
    t_comm, chunks = comm_time_s(ds, cost, world_size, rates)
    sms_left = H200.sms if ds.backend == "ce" else max(H200.sms - ds.comm_ctas, 1)
    pieces = 1 + chunks * max(world_size - 1, 0)
    t_comp = cost.flops / rates.matmul_flops_per_s * H200.sms / sms_left + pieces * LAUNCH_S
    t_comp = max(t_comp, cost.memory_bytes / rates.hbm_bytes_per_s)
    if ds.compression != "none":
        t_comp += codec_time_s(ds, cost, world_size, rates)
    if ds.placement == "deferred":
        return t_comm + t_comp
    exposed = min(t_comm, t_comp) / pieces
    if ds.placement == "fused":
        exposed *= 0.5  # tile-level consumers start on smaller units
    return max(t_comm, t_comp) + exposed
