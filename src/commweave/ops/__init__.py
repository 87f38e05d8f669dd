"""The best kernels as PyTorch ops, called from a user's own distributed program.

    import torch.distributed as dist, commweave.ops as cw
    dist.init_process_group("nccl")  # one process per GPU (gloo on CPU runs the baselines)
    out = cw.gemm_allgather(a_shard, b_local, group=tp_group)  # the seed; or program="best.py"
    op = cw.load("best.py"); out = op(a=a_shard, b=b_local)    # a file `commweave export` wrote

Every op is a `torch.ops.commweave.*` custom op (torch.compile keeps it in its graph, a caller's
CUDA graph can capture it after its first call of a shape), collective over its `group=` (all its
ranks, same order, same shapes), local on one rank; gemm_allgather and gemm_reducescatter have
backward, and `commweave.nn` builds tensor-parallel layers from them. `close()` frees what the ops
hold.
"""

from commweave.ops import library  # registers the custom ops
from commweave.ops.exported import EXPORT_PREFIX, export_info, export_text
from commweave.ops.functions import (context_parallel_attention, gemm_allgather, gemm_reducescatter, load, moe_layer,
                                     op, transfer_kv)
from commweave.ops.groups import group_name
from commweave.ops.runner import Op, ProgramSpec, close, context, symmetric_zeros

__all__ = [
    "EXPORT_PREFIX", "Op", "ProgramSpec", "close", "context", "context_parallel_attention", "export_info",
    "export_text", "gemm_allgather", "gemm_reducescatter", "group_name", "library", "load", "moe_layer", "op",
    "symmetric_zeros", "transfer_kv",
]
