"""The physical floor: no correct program can be faster than its FLOPs, peer bytes or HBM bytes allow.

A measured time below the floor means the timer missed work (or the check missed a cheat), so the
program is `suspect` and scores 0. The rates are what the machine achieves (cuBLAS on random data,
copy engines), measured once per pool by `calibrate`; defaults are the H200 numbers of
shared/reference/DEVICE.md. FLOOR_MARGIN absorbs timing noise around a floor-speed program.
"""

from __future__ import annotations

from dataclasses import dataclass

from commweave.contracts.profile import H200
from commweave.contracts.verdict import EvaluationError, FailureClass, Verdict
from commweave.runtime.pool import WorkerPool
from commweave.contracts.workload import Cost

FLOOR_MARGIN = 0.1  # a median within 10% under the floor is timing noise; further under is suspect


@dataclass(frozen=True)
class MachineRates:
    """What the machine achieves, measured by `calibrate`; the profile's figures until then."""

    matmul_flops_per_s: float = H200.matmul_flops_per_s
    link_bytes_per_s: float = H200.link_bytes_per_s
    hbm_bytes_per_s: float = H200.hbm_bytes_per_s


def floor_s(cost: Cost, rates: MachineRates) -> float:
    """The time the busiest resource needs, assuming perfect overlap of the others."""
    return max(cost.flops / rates.matmul_flops_per_s, cost.comm_bytes * cost.wire_ratio / rates.link_bytes_per_s,
               cost.memory_bytes / rates.hbm_bytes_per_s)


def below_floor(median_s: float, floor: float, margin: float = FLOOR_MARGIN) -> Verdict | None:
    """A `suspect` verdict when `median_s` beats the floor by more than the noise margin."""
    if median_s < floor * (1.0 - margin):
        return Verdict.failed(FailureClass.SUSPECT, f"median {median_s * 1e6:.2f} µs is below the physical floor "
                                                    f"{floor * 1e6:.2f} µs (margin {margin:.0%})")
    return None


def calibrate(pool: WorkerPool, timeout_s: float | None = None) -> MachineRates:
    """Measure the rates in the pool's workers: the fastest rank's matmul and HBM copy, rank 0's
    peer copy (fastest rates give the lowest floor, so calibration never manufactures suspects)."""
    result = pool.run("commweave.evaluate.jobs:calibrate_rates", timeout_s=timeout_s)
    if not result.ok:
        failure = result.first_failure()
        raise EvaluationError(f"calibration failed: {failure.error_type if failure else result.status}: "
                              f"{failure.message if failure else ''}")
    defaults = MachineRates()
    links = [v["link"] for v in result.values if v["link"] is not None]
    return MachineRates(
        matmul_flops_per_s=max(v["matmul"] for v in result.values),
        link_bytes_per_s=max(links) if links else defaults.link_bytes_per_s,
        hbm_bytes_per_s=max(v["hbm"] for v in result.values),
    )
