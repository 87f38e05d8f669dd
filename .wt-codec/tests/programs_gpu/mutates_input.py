"""Broken (gemm-allgather): a correct result, then a kernel flips the sign of a[0, 0] in place
(expected: wrong_result, input 'a' was modified)."""

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
CUDA_SRC = r"""
extern "C" __global__ void cw_flip_first_sign(unsigned short* x) {
  x[0] ^= 0x8000;
}
"""


def setup(ctx, shape):
    a_full = torch.empty(shape["M"], shape["K"], dtype=torch.bfloat16, device=ctx.device)
    return {"a_full": a_full, "flip": ctx.compile(CUDA_SRC, "mutates_input").kernel("cw_flip_first_sign")}


def run(ctx, state, inputs, out):
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(state["a_full"], inputs["a"], group=ctx.group)
    torch.matmul(state["a_full"], inputs["b"], out=out)
    state["flip"].launch(1, 1, [inputs["a"]])
# EVOLVE-BLOCK-END
