"""Jobs for tests/test_attention_cp.py, run inside WorkerPool workers (imported by name)."""

from __future__ import annotations

import torch

from commweave.evaluate.program import load_program
from commweave.workloads.attention_cp.workload import AttentionCP


def run_program_check(ctx, program: str, shape_text: str, seed: int, calls: int = 2) -> dict[str, float | bool]:
    """Run an attention-cp program `calls` times (fresh poison each time): its relative Frobenius
    error against the reference, and whether it left its inputs as they were."""
    workload = AttentionCP()
    shape = workload.parse_shape(shape_text, ctx.world_size)
    module = load_program(workload.program_text(program), program)
    reason = module.available(ctx) if hasattr(module, "available") else None
    if reason:
        raise RuntimeError(f"{program} is not available here: {reason}")
    inputs = workload.make_inputs(shape, ctx.world_size, ctx.rank, seed, ctx.device)
    out = workload.make_output(shape, ctx.world_size, ctx.rank, ctx.device)
    state = module.setup(ctx, shape)
    for _ in range(calls):  # a second call catches state that only works once (flags, buffers)
        out.fill_(float("nan"))
        module.run(ctx, state, inputs, out)
    ctx.synchronize()
    if hasattr(module, "teardown"):
        module.teardown(ctx, state)
    ctx.end_candidate()
    ref = workload.reference(shape, ctx.world_size, ctx.rank, seed, ctx.device)
    pristine = workload.make_inputs(shape, ctx.world_size, ctx.rank, seed, ctx.device)
    intact = all(torch.equal(inputs[name], pristine[name]) for name in pristine)
    return {"error": float((out.float() - ref).norm() / ref.norm()), "inputs_intact": intact}


def program_availability(ctx) -> dict[str, str | None]:
    """Each attention-cp program's `available(ctx)` answer on this rank (None: runs here)."""
    workload = AttentionCP()
    reasons: dict[str, str | None] = {}
    for name in workload.program_names():
        module = load_program(workload.program_text(name), name)
        reasons[name] = module.available(ctx) if hasattr(module, "available") else None
    return reasons
