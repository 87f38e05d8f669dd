"""Training-step timings for `commweave bench`: an op with a backward timed forward + backward
beside its forward, as a job on every rank of a worker pool (the slowest rank is the step's time).

`STEPS` maps a workload to its job. attention-cp (`attention_step_times`), per rank, batch 1 on the
workload's inputs: `forward` (the forward-only op: the seed, or on CPU its host baseline),
`ring_forward` (the differentiable op's forward, which keeps the LSE), `train` (its forward +
backward), and where torch has it `torch_cp_train` (torch's ring flash attention forward and its
backward, as `context_parallel` runs them; CUDA only). Backward's FLOPs are 2.5x the forward's
(dQ, dK, dV and the recomputed scores), so a training step's floor is 3.5x the forward's FLOPs.
"""

from __future__ import annotations

import importlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from commweave.ops.groups import group_name
from commweave.workloads import get_workload

#: a training step's FLOPs over its forward's (forward 1 + backward 2.5)
TRAIN_FLOPS_FACTOR = 3.5


def _times(ctx: Any, fn: Callable[[], Any], warmup: int, iters: int) -> float:
    """Median ms of `fn` over `iters` runs after `warmup`, every rank starting each run together."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if ctx.is_cuda:
            torch.cuda.synchronize(ctx.device)
        dist.barrier(group=ctx.cpu_group)
        start = time.perf_counter()
        fn()
        if ctx.is_cuda:
            torch.cuda.synchronize(ctx.device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _torch_cp_step(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   causal: bool) -> Callable[[], Any] | None:
    """torch's ring flash attention forward then its backward on [1, H, S/W, D] views (K/V repeated
    per query head: torch's ring needs Hkv = Hq), or None where torch lacks it or not on CUDA."""
    if not ctx.is_cuda:
        return None
    module = None
    for name in ("torch.distributed.tensor.experimental._context_parallel._attention",
                 "torch.distributed.tensor.experimental._attention"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        break
    needed = ("_scaled_dot_product_ring_flash_attention", "_scaled_dot_product_ring_flash_attention_backward",
              "_cp_options")
    if module is None or not all(hasattr(module, f) for f in needed):
        return None
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(ctx.group, "cuda")
    group = q.shape[2] // k.shape[2]
    kr, vr = (t[0].repeat_interleave(group, dim=1) for t in (k, v))
    qh, kh, vh, gh = (t.transpose(0, 1).unsqueeze(0) for t in (q[0], kr, vr, g[0]))
    scale = q.shape[-1] ** -0.5

    def step() -> None:
        saved = module._cp_options.enable_load_balance
        module._cp_options.enable_load_balance = causal
        try:
            res = module._scaled_dot_product_ring_flash_attention(mesh, qh, kh, vh, is_causal=causal, scale=scale)
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset = res[:8]
            module._scaled_dot_product_ring_flash_attention_backward(
                mesh, gh, qh, kh, vh, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
        finally:
            module._cp_options.enable_load_balance = saved
    return step


def attention_step_times(ctx: Any, shape_text: str, iters: int, warmup: int) -> dict[str, float]:
    """ms per call on this rank of attention-cp's forward, the ring forward, the training step and
    torch's (where present) on `shape_text`, and the step's FLOPs."""
    wl = get_workload("attention-cp")
    shape = wl.parse_shape(shape_text, ctx.world_size)
    causal = bool(shape["CAUSAL"])
    inputs = wl.make_inputs(shape, ctx.world_size, ctx.rank, 0, ctx.device)
    q, k, v = (inputs[n].unsqueeze(0) for n in ("q", "k", "v"))
    g = torch.randn_like(q)
    name = group_name(ctx.group)
    lse_op = torch.ops.commweave.context_parallel_attention_lse
    times: dict[str, float] = {}
    with torch.no_grad():
        times["forward"] = _times(ctx, lambda: torch.ops.commweave.context_parallel_attention(
            q[0], k[0], v[0], causal, name, None), warmup, iters)
        times["ring_forward"] = _times(ctx, lambda: lse_op(q, k, v, causal, causal, name), warmup, iters)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def train() -> None:
        for t in (qg, kg, vg):
            t.grad = None
        lse_op(qg, kg, vg, causal, causal, name)[0].backward(g)

    times["train"] = _times(ctx, train, warmup, iters)
    theirs = _torch_cp_step(ctx, q, k, v, g, causal)
    if theirs is not None:
        times["torch_cp_train"] = _times(ctx, theirs, warmup, iters)
    times["train_flops"] = TRAIN_FLOPS_FACTOR * wl.ideal_flops(shape, ctx.world_size, ctx.rank)
    return times


STEPS = {"attention-cp": attention_step_times}
