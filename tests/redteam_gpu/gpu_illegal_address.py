"""Sets up cleanly, then its kernel stores through the pointer 0x10 in run(): a sticky CUDA error
in its own process. Expected: illegal_address, and the next program judged on a working pool."""

# EVOLVE-BLOCK-START
CUDA_SRC = r"""
extern "C" __global__ void cw_store(float* p) {
  p[threadIdx.x] = 1.0f;
}
"""


def setup(ctx, shape):
    return {"store": ctx.compile(CUDA_SRC, "redteam_illegal").kernel("cw_store")}


def run(ctx, state, inputs, out):
    state["store"].launch(1, 32, [0x10])
# EVOLVE-BLOCK-END
