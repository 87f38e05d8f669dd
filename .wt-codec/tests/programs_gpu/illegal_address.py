"""Broken (gemm-allgather): a kernel stores through the pointer 0x10 (expected: illegal_address,
the worker pool restarted)."""

# EVOLVE-BLOCK-START
CUDA_SRC = r"""
extern "C" __global__ void cw_store(float* p) {
  p[threadIdx.x] = 1.0f;
}
"""


def setup(ctx, shape):
    return {"store": ctx.compile(CUDA_SRC, "illegal_address").kernel("cw_store")}


def run(ctx, state, inputs, out):
    state["store"].launch(1, 32, [0x10])
# EVOLVE-BLOCK-END
