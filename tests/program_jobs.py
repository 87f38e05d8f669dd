"""Jobs that run one workload's program inside WorkerPool workers (imported by name), shared by
the workload tests: spawned workers inherit sys.path, where pytest has put tests/."""

from __future__ import annotations

import torch

from commweave.evaluate.jobs import harness_output
from commweave.contracts.program import load_program, unavailable_reason, with_config
from commweave.workloads import get_workload


def run_program_check(ctx, workload: str, program: str, shape_text: str, seed: int, calls: int = 2,
                      config: dict | None = None) -> dict[str, float | bool]:
    """Run a program (CONFIG knobs set from `config`) `calls` times on one state, with fresh inputs
    (a new seed) and a NaN-filled output each call: the largest relative Frobenius error against
    the reference, and whether every call left its inputs as they were. A second call catches
    state that only works once; fresh inputs catch a result cached from an earlier call."""
    wl = get_workload(workload)
    shape = wl.parse_shape(shape_text, ctx.world_size)
    text = wl.program_text(program)
    module = load_program(with_config(text, **config) if config else text, program)
    reason = unavailable_reason(module, ctx)
    if reason:
        raise RuntimeError(f"{program} is not available here: {reason}")
    out = harness_output(ctx, wl, shape)  # as the evaluator makes it (symmetric where the workload asks)
    state = module.setup(ctx, shape)
    worst, intact = 0.0, True
    for call in range(calls):
        inputs = wl.make_inputs(shape, ctx.world_size, ctx.rank, seed + call, ctx.device)
        out.fill_(float("nan"))
        module.run(ctx, state, inputs, out)
        ctx.synchronize()
        ref = wl.reference(shape, ctx.world_size, ctx.rank, seed + call, ctx.device)
        worst = max(worst, float((out.float() - ref).norm() / ref.norm()))
        pristine = wl.make_inputs(shape, ctx.world_size, ctx.rank, seed + call, ctx.device)
        intact = intact and all(torch.equal(inputs[name], pristine[name]) for name in pristine)
    if hasattr(module, "teardown"):
        module.teardown(ctx, state)
    ctx.end_candidate()
    return {"error": worst, "inputs_intact": intact}


def program_availability(ctx, workload: str) -> dict[str, str | None]:
    """Each of the workload's programs' `available(ctx)` answer on this rank (None: runs here)."""
    wl = get_workload(workload)
    reasons: dict[str, str | None] = {}
    for name in wl.program_names():
        module = load_program(wl.program_text(name), name)
        reasons[name] = unavailable_reason(module, ctx)
    return reasons


def check_on_gpus(workload: str, program: str, world: int, shape_texts: list[str], seed: int,
                  config: dict | None = None, calls: int = 3) -> None:
    """The GPU tests' common body (called from the test process, not a job): skip without `world`
    GPUs, else `run_program_check` on each shape in a CUDA pool, asserting success, untouched
    inputs and an error under the workload's tolerance."""
    import pytest

    from commweave.runtime import WorkerPool

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    tolerance = get_workload(workload).tolerance()
    what = f"{program}{' ' + str(config) if config else ''}"
    with WorkerPool(world, device="cuda", job_timeout_s=300) as pool:
        for shape in shape_texts:
            result = pool.run("program_jobs:run_program_check", workload=workload, program=program, shape_text=shape,
                              seed=seed, calls=calls, config=config)
            assert result.ok, f"{what} {shape}: {result.first_failure()}"
            for value in result.values:
                assert value["inputs_intact"], f"{what} {shape} modified its inputs"
                assert value["error"] < tolerance, f"{what} {shape}: error {value['error']:.3g}"


def device_memory(ctx) -> int:
    """The bytes torch has allocated on this judge's GPU (its own tensors, not what it maps)."""
    torch.cuda.synchronize(ctx.device)
    return torch.cuda.memory_allocated(ctx.device)
