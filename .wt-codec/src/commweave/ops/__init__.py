"""The best kernels as PyTorch ops, called from a user's own distributed program.

    import torch.distributed as dist, commweave.ops as cw
    dist.init_process_group("nccl")  # one process per GPU (gloo on CPU runs the baselines)
    out = cw.gemm_allgather(a_shard, b_local)             # the seed; or program="best.py"
    op = cw.load("best.py"); out = op(a=a_shard, b=b_local)  # a file `commweave export` wrote

Every op is collective (all ranks, same order, same shapes). `close()` frees what the ops hold.
"""

from commweave.ops.exported import EXPORT_PREFIX, export_info, export_text
from commweave.ops.functions import context_parallel_attention, gemm_allgather, load, moe_layer, op, transfer_kv
from commweave.ops.runner import Op, ProgramSpec, close, context, symmetric_zeros

__all__ = [
    "EXPORT_PREFIX", "Op", "ProgramSpec", "close", "context", "context_parallel_attention", "export_info",
    "export_text", "gemm_allgather", "load", "moe_layer", "op", "symmetric_zeros", "transfer_kv",
]
