"""Multi-GPU runtime: NCCL binding, symmetric windows, device communicators, compile cache,
kernel launch, the worker pool and confinement. Imports only the contracts of commweave."""

from commweave.runtime.confine import apply_safe_env
from commweave.runtime.pool import JobResult, PoolStartError, RankFailure, WorkerPool

__all__ = ["JobResult", "PoolStartError", "RankFailure", "WorkerPool", "apply_safe_env"]
