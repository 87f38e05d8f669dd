"""Peer baseline: torch's async tensor parallelism, `symm_mem.fused_matmul_reduce_scatter`.

torch multiplies A's row blocks one at a time (the block of rank - 1 first) into a symmetric double
buffer; after a barrier the block's owner copies it out while the next is multiplied (two streams
alternate), and each rank finally sums its W stacked partials with one `torch.sum`. It returns a
fresh output, so the result is copied into `out` (one extra [M/W, N] pass). At one rank there is
nothing to overlap, so it is not offered there.
"""

import warnings

import torch

# EVOLVE-BLOCK-START
def available(ctx):
    if not ctx.is_cuda:
        return "fused_matmul_reduce_scatter needs CUDA GPUs"
    if ctx.world_size < 2:
        return "async TP overlaps communication between ranks; at one rank there is none"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  (registers torch.ops.symm_mem)
    except ImportError as exc:
        return f"torch.distributed._symmetric_memory is missing: {exc}"
    if not hasattr(torch.ops.symm_mem, "fused_matmul_reduce_scatter"):
        return f"torch {torch.__version__} has no torch.ops.symm_mem.fused_matmul_reduce_scatter"
    return None


def setup(ctx, shape):
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    # Needed by torch 2.11; torch 2.13 deprecates it as a no-longer-needed (harmless) call.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(ctx.group_name)
    return {}


def run(ctx, state, inputs, out):
    reduced = torch.ops.symm_mem.fused_matmul_reduce_scatter(inputs["a"], inputs["b"], "sum", 0, ctx.group_name)
    out.copy_(reduced)
# EVOLVE-BLOCK-END
