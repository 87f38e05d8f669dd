"""Multi-GPU runtime: NCCL binding, symmetric windows, device communicators, compile cache,
kernel launch and the worker pool. Imports nothing else of commweave."""

from commweave.runtime.pool import JobResult, PoolStartError, RankFailure, WorkerPool, apply_safe_env

__all__ = ["JobResult", "PoolStartError", "RankFailure", "WorkerPool", "apply_safe_env"]
