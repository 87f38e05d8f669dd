"""Broken: its CUDA source does not compile (expected: compile_error with nvcc's message)."""

# EVOLVE-BLOCK-START
CUDA_SRC = r"""
#include <nccl_device.h>
extern "C" __global__ void scale(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= undeclared_factor;
}
"""


def setup(ctx, shape):
    return {"kernel": ctx.compile(CUDA_SRC).scale}


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
