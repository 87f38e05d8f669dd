"""Jobs for tests/test_kv_transfer.py, run inside WorkerPool workers (imported by name)."""

from __future__ import annotations

import torch

from commweave.contracts.poison import poison_
from commweave.evaluate.checks import judge_output
from commweave.evaluate.jobs import harness_output
from commweave.contracts.program import load_program, unavailable_reason, with_config
from commweave.workloads.kv_transfer.workload import KvTransfer


def run_program_check(ctx, program: str, shape_text: str, seed: int, calls: int = 2, config: dict | None = None) -> dict:
    """Run a kv-transfer program (CONFIG knobs set from `config`) `calls` times on fresh inputs (a
    new seed each call, one state): the strict judgement (bit-exact pages, poison kept elsewhere),
    the harness's judgement, and whether the inputs were left as they were."""
    workload = KvTransfer()
    shape = workload.parse_shape(shape_text, ctx.world_size)
    text = workload.program_text(program)
    module = load_program(with_config(text, **config) if config else text, program)
    reason = unavailable_reason(module, ctx)
    if reason:
        raise RuntimeError(f"{program} is not available here: {reason}")
    state = module.setup(ctx, shape)
    problems: list[str] = []
    harness: list[str] = []
    intact = True
    for call in range(calls):
        inputs = workload.make_inputs(shape, ctx.world_size, ctx.rank, seed + call, ctx.device)
        pristine = {k: v.clone() for k, v in inputs.items()}
        out = poison_(harness_output(ctx, workload, shape))  # symmetric on GPUs, as the evaluator makes it
        module.run(ctx, state, dict(inputs), out)
        ctx.synchronize()
        strict = workload.judge_strict(out, shape, ctx.world_size, ctx.rank, seed + call)
        if strict:
            problems.append(f"call {call}: {strict}")
        ref = workload.reference(shape, ctx.world_size, ctx.rank, seed + call, ctx.device)
        untouched = workload.untouched(shape, ctx.world_size, ctx.rank, seed + call, ctx.device)
        verdict = judge_output(out, ref, workload.tolerance(), untouched)
        if not verdict.ok:
            harness.append(f"call {call}: {verdict.message}")
        intact &= all(torch.equal(inputs[k], pristine[k]) for k in pristine)
    if hasattr(module, "teardown"):
        module.teardown(ctx, state)
    ctx.end_candidate()
    return {"strict": problems, "harness": harness, "inputs_intact": intact}
