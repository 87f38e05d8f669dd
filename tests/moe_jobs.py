"""Jobs for tests/test_moe.py, run inside WorkerPool workers (imported by name)."""

from __future__ import annotations

import torch

from commweave.evaluate.program import load_program, with_config
from commweave.workloads.moe.workload import MoELayer


def run_program_check(ctx, program: str, shape_text: str, seed: int, calls: int = 2,
                      config: dict | None = None) -> dict[str, float | bool]:
    """Run a moe program (with CONFIG knobs set from `config`) `calls` times on fresh inputs per
    call (a new seed each), poisoning the output before each: the largest relative Frobenius error
    against the reference, and whether it left its inputs as they were."""
    workload = MoELayer()
    shape = workload.parse_shape(shape_text, ctx.world_size)
    text = workload.program_text(program)
    module = load_program(with_config(text, **config) if config else text, program)
    reason = module.available(ctx) if hasattr(module, "available") else None
    if reason:
        raise RuntimeError(f"{program} is not available here: {reason}")
    out = workload.make_output(shape, ctx.world_size, ctx.rank, ctx.device)
    state = module.setup(ctx, shape)
    worst, intact = 0.0, True
    for call in range(calls):  # fresh inputs each call: a result cached from an earlier call fails
        inputs = workload.make_inputs(shape, ctx.world_size, ctx.rank, seed + call, ctx.device)
        out.fill_(float("nan"))
        module.run(ctx, state, inputs, out)
        ctx.synchronize()
        ref = workload.reference(shape, ctx.world_size, ctx.rank, seed + call, ctx.device)
        worst = max(worst, float((out.float() - ref).norm() / ref.norm()))
        pristine = workload.make_inputs(shape, ctx.world_size, ctx.rank, seed + call, ctx.device)
        intact = intact and all(torch.equal(inputs[name], pristine[name]) for name in pristine)
    if hasattr(module, "teardown"):
        module.teardown(ctx, state)
    ctx.end_candidate()
    return {"error": worst, "inputs_intact": intact}


def program_availability(ctx) -> dict[str, str | None]:
    """Each moe program's `available(ctx)` answer on this rank (None: runs here)."""
    workload = MoELayer()
    reasons: dict[str, str | None] = {}
    for name in workload.program_names():
        module = load_program(workload.program_text(name), name)
        reasons[name] = module.available(ctx) if hasattr(module, "available") else None
    return reasons
