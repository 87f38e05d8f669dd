"""Broken (gemm-allgather): a correct result, then a kernel flips the sign of out's first row
(expected: wrong_result; the error is about 2/sqrt(M), far above bf16's 1e-2)."""

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
CUDA_SRC = r"""
extern "C" __global__ void cw_flip_signs(unsigned short* x, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] ^= 0x8000;  // the sign bit of a bf16
}
"""


def setup(ctx, shape):
    a_full = torch.empty(shape["M"], shape["K"], dtype=torch.bfloat16, device=ctx.device)
    return {"a_full": a_full, "flip": ctx.compile(CUDA_SRC, "wrong_values").kernel("cw_flip_signs")}


def run(ctx, state, inputs, out):
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(state["a_full"], inputs["a"], group=ctx.group)
    torch.matmul(state["a_full"], inputs["b"], out=out)
    n = out.shape[1]
    state["flip"].launch((n + 255) // 256, 256, [out, n])
# EVOLVE-BLOCK-END
