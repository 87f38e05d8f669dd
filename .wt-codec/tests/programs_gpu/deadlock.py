"""Broken (gemm-allgather): a kernel spins on a flag nobody sets, the common distributed bug
(expected: timeout, the worker pool restarted)."""

import torch

# EVOLVE-BLOCK-START
CUDA_SRC = r"""
extern "C" __global__ void cw_wait_forever(volatile unsigned long long* flag) {
  while (*flag == 0) {
  }
}
"""


def setup(ctx, shape):
    flag = torch.zeros(1, dtype=torch.int64, device=ctx.device)
    return {"flag": flag, "wait": ctx.compile(CUDA_SRC, "deadlock").kernel("cw_wait_forever")}


def run(ctx, state, inputs, out):
    state["wait"].launch(1, 1, [state["flag"]])
# EVOLVE-BLOCK-END
