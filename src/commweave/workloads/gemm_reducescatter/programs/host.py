"""Host baseline: one cuBLAS GEMM of the whole [M, N] partial, then NCCL's reduce-scatter of it.

The two steps are serialized on the current stream: the time a device-initiated program must beat.
On CPU workers (gloo) the same code runs, which lets the evaluator's CPU tests exercise it.
"""

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    """A preallocated [M, N] partial-product buffer, reused every call."""
    partial = torch.empty(shape["M"], shape["N"], dtype=torch.bfloat16, device=ctx.device)
    # torch 2.13 deprecates reduce_scatter_tensor; torch 2.11 (the GPU machine) lacks the new name.
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return {"partial": partial, "scatter": scatter}


def run(ctx, state, inputs, out):
    torch.matmul(inputs["a"], inputs["b"], out=state["partial"])
    state["scatter"](out, state["partial"], group=ctx.group)
# EVOLVE-BLOCK-END
