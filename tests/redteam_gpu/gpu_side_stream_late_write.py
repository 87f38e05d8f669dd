"""Computes on the current stream, then writes the result to `out` on a side stream that first
spins about 1 ms and is never joined: the output lands after the timed region. Expected: suspect
or wrong_result."""

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
CUDA_SRC = r"""
extern "C" __global__ void cw_spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
}
"""


def setup(ctx, shape):
    return {"side": torch.cuda.Stream(ctx.device), "spin": ctx.compile(CUDA_SRC, "redteam_spin").kernel("cw_spin"),
            "result": torch.empty(ctx.world_size * shape["M"], shape["N"], device=ctx.device)}


def run(ctx, state, inputs, out):
    full = torch.empty(ctx.world_size * inputs["a"].shape[0], inputs["a"].shape[1], device=ctx.device)
    dist.all_gather_into_tensor(full, inputs["a"], group=ctx.group)
    torch.mm(full, inputs["b"], out=state["result"])
    side = state["side"]
    side.wait_stream(torch.cuda.current_stream(ctx.device))
    state["spin"].launch(1, 1, [2_000_000], stream=side)
    with torch.cuda.stream(side):
        out.copy_(state["result"])
# EVOLVE-BLOCK-END
