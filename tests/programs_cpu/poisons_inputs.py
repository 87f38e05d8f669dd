"""Hostile: computes its output, then fills its inputs with NaN, hoping a baseline reads them next
(expected: wrong_result, input modified; the baseline beside it is unaffected)."""

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {}


def run(ctx, state, inputs, out):
    parts = [torch.empty_like(inputs["a"]) for _ in range(ctx.world_size)]
    dist.all_gather(parts, inputs["a"], group=ctx.group)
    torch.mm(torch.cat(parts), inputs["b"], out=out)
    for tensor in inputs.values():
        tensor.fill_(float("nan"))
# EVOLVE-BLOCK-END
