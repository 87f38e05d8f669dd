"""Peer baseline: PyTorch's context-parallel ring attention (torch.distributed.tensor.experimental).

Calls the function `context_parallel` dispatches SDPA to, `_scaled_dot_product_ring_flash_attention`,
on this rank's shards directly: torch rotates K and V between ranks (all-to-all or all-gather
rotater) and merges flash attention blocks by LSE. Its load-balanced causal layout is ours (chunks
r and 2W-1-r in that order), switched on for causal shapes only (torch refuses it otherwise).
torch's ring assumes as many KV heads as query heads, so for GQA K and V are repeated per query
head before the call (CONFIG repeat_kv): torch then moves Hq/Hkv times more bytes than the other
programs. repeat_kv=False hands the flash op grouped heads directly (untried on GPUs).
"""

import torch

# EVOLVE-BLOCK-START
CONFIG = dict(
    rotate="alltoall",  # torch's rotater: "alltoall" (a ring of exchanges) or "allgather"
    repeat_kv=True,  # repeat K/V per query head for GQA; False passes Hkv heads to the flash op (untried)
)


def _cp_module():
    import importlib

    for name in ("torch.distributed.tensor.experimental._context_parallel._attention",
                 "torch.distributed.tensor.experimental._attention"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if all(hasattr(module, f) for f in ("_scaled_dot_product_ring_flash_attention", "_cp_options", "set_rotate_method")):
            return module
    return None


def available(ctx):
    if not ctx.is_cuda:
        return "torch's context-parallel attention runs flash attention kernels and needs CUDA GPUs"
    if _cp_module() is None:
        return f"torch {torch.__version__} has no _scaled_dot_product_ring_flash_attention with _cp_options"
    try:
        from torch.distributed.device_mesh import DeviceMesh  # noqa: F401
    except ImportError as exc:
        return f"torch.distributed.device_mesh is missing: {exc}"
    return None


def setup(ctx, shape):
    from torch.distributed.device_mesh import DeviceMesh

    module = _cp_module()
    module.set_rotate_method(CONFIG["rotate"])
    mesh = DeviceMesh.from_group(ctx.group, "cuda")
    return {"module": module, "mesh": mesh, "causal": bool(shape["CAUSAL"]), "scale": shape["D"] ** -0.5,
            "group": shape["HQ"] // shape["HKV"]}


def run(ctx, state, inputs, out):
    module, group = state["module"], state["group"]
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    if group > 1 and CONFIG["repeat_kv"]:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    saved = module._cp_options.enable_load_balance
    module._cp_options.enable_load_balance = state["causal"]  # process-wide torch state, restored below
    try:
        res = module._scaled_dot_product_ring_flash_attention(
            state["mesh"], q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), is_causal=state["causal"], scale=state["scale"])
    finally:
        module._cp_options.enable_load_balance = saved
    out.copy_(res[0][0].transpose(0, 1))
# EVOLVE-BLOCK-END
