"""Broken (gemm-allgather): the first call is computed correctly, every later call replays it
(expected: wrong_result on the second seed)."""

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    a_full = torch.empty(shape["M"], shape["K"], dtype=torch.bfloat16, device=ctx.device)
    return {"a_full": a_full, "cached": None}


def run(ctx, state, inputs, out):
    if state["cached"] is None:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(state["a_full"], inputs["a"], group=ctx.group)
        state["cached"] = torch.matmul(state["a_full"], inputs["b"])
    out.copy_(state["cached"])
# EVOLVE-BLOCK-END
