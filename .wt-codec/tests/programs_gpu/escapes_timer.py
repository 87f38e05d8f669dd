"""Broken (gemm-allgather): the result is right, but it is written to `out` on a side stream that
first sleeps about 1 ms and is never joined back to the current stream. The device-wide sync of
the correctness check waits for it (the check passes); the timed region ends without it
(expected from the benchmark: suspect)."""

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
CUDA_SRC = r"""
extern "C" __global__ void cw_sleep(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
}
"""


def setup(ctx, shape):
    a_full = torch.empty(shape["M"], shape["K"], dtype=torch.bfloat16, device=ctx.device)
    result = torch.empty(shape["M"], shape["N"] // ctx.world_size, dtype=torch.bfloat16, device=ctx.device)
    return {"a_full": a_full, "result": result, "side": ctx.stream("escape"),
            "sleep": ctx.compile(CUDA_SRC, "escapes_timer").kernel("cw_sleep")}


def run(ctx, state, inputs, out):
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(state["a_full"], inputs["a"], group=ctx.group)
    torch.matmul(state["a_full"], inputs["b"], out=state["result"])
    side = state["side"]
    side.wait_stream(torch.cuda.current_stream(ctx.device))
    state["sleep"].launch(1, 1, [2_000_000], stream=side)
    with torch.cuda.stream(side):
        out.copy_(state["result"])
# EVOLVE-BLOCK-END
