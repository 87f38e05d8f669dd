"""Broken (gemm-allgather): computes the right product into its own buffer, never into `out`
(expected: wrong_result, output not written)."""

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    a_full = torch.empty(shape["M"], shape["K"], dtype=torch.bfloat16, device=ctx.device)
    mine = torch.empty(shape["M"], shape["N"] // ctx.world_size, dtype=torch.bfloat16, device=ctx.device)
    return {"a_full": a_full, "mine": mine}


def run(ctx, state, inputs, out):
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(state["a_full"], inputs["a"], group=ctx.group)
    torch.matmul(state["a_full"], inputs["b"], out=state["mine"])
# EVOLVE-BLOCK-END
