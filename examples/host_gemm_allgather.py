"""A user's host-driven GEMM + AllGather: the input `commweave agent fast-path` converts.

The column-parallel linear layer of tensor parallelism, as one would write it with PyTorch: every
rank holds a row shard of A [M/W, K] and a column shard of B [K, N/W]; NCCL gathers A's shards
into one [M, K] buffer, then cuBLAS multiplies it by the local B. The CPU issues the collective,
and the GEMM waits for all of it.

It is close to the gemm-allgather workload's own host baseline (`programs/host.py`) on purpose:
it computes the same thing, in the program format (setup/run between EVOLVE-BLOCK markers), so the
cascade can check it. It exists separately because the fast path's input is a user's file, not a
harness baseline: it calls `all_gather_into_tensor` directly, as user code does (the baseline
picks between torch versions' names), which is what the static analysis reads.

    commweave agent fast-path examples/host_gemm_allgather.py --workload gemm-allgather --gpus 2 --llm MODEL
"""

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    """The gathered A, allocated once and reused by every call."""
    a_full = torch.empty(shape["M"], shape["K"], dtype=torch.bfloat16, device=ctx.device)
    return {"a_full": a_full}


def run(ctx, state, inputs, out):
    """out [M, N/W] = all_gather(A shards) @ B_local."""
    dist.all_gather_into_tensor(state["a_full"], inputs["a"], group=ctx.group)
    torch.matmul(state["a_full"], inputs["b"], out=out)
# EVOLVE-BLOCK-END
