"""Where a program's time goes: run one workload program on the GPUs under torch.profiler and
print each rank-0 kernel's share of the GPU time (top --top by total CUDA time).

    python bench/profile_program.py moe host --gpus 2 --shape dsv3-T4096 [--config comm_ctas=32]

Warm-up calls first (graph capture, lazy handles), then --calls profiled calls. Writes the table
and a Chrome trace of rank 0 under --out-dir.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from commweave.runtime import WorkerPool, apply_safe_env


def profile_job(ctx, workload: str, program: str, shape_text: str, config: dict, calls: int, top: int,
                out_dir: str) -> str:
    """Runs inside each worker: set up, warm up, profile `calls` calls; rank 0 returns the table."""
    from torch.profiler import ProfilerActivity, profile

    from commweave.evaluate.jobs import harness_output
    from commweave.contracts.program import load_program, with_config
    from commweave.workloads import get_workload

    wl = get_workload(workload)
    shape = wl.parse_shape(shape_text, ctx.world_size)
    text = wl.program_text(program)
    module = load_program(with_config(text, **config) if config else text, program)
    inputs = wl.make_inputs(shape, ctx.world_size, ctx.rank, 1, ctx.device)
    out = harness_output(ctx, wl, shape)
    state = module.setup(ctx, shape)
    for _ in range(3):
        module.run(ctx, state, inputs, out)
    ctx.synchronize()
    ctx.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            module.run(ctx, state, inputs, out)
        ctx.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=70)
    if ctx.rank == 0:
        prof.export_chrome_trace(str(Path(out_dir) / f"trace-{workload}-{program}-{shape_text}.json"))
    if hasattr(module, "teardown"):
        module.teardown(ctx, state)
    ctx.end_candidate()
    return table


def profile_and_write(gpus: int, job: str, kwargs: dict, path: Path, calls: int) -> None:
    """Run `job` (module:function returning rank 0's table) on a pool of `gpus` workers, write the
    command line and the table to `path` and print it."""
    apply_safe_env()
    path.parent.mkdir(parents=True, exist_ok=True)
    with WorkerPool(gpus, device="cuda", job_timeout_s=600) as pool:
        result = pool.run(job, **kwargs)
    if not result.ok:
        sys.exit(f"profiling failed: {result.first_failure()}")
    table = result.values[0]
    path.write_text(f"{' '.join(sys.argv)}\n{calls} calls, rank 0\n{table}\n")
    print(table)
    print("table:", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload")
    parser.add_argument("program")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--shape", required=True)
    parser.add_argument("--config", action="append", default=[], help="knob=value (repeatable)")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out-dir", type=Path, default=Path("bench/logs"))
    args = parser.parse_args()
    from sweep import parse_grid  # bench/ is on sys.path when this runs as a script

    config = {knob: values[0] for knob, values in parse_grid(args.config).items()}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    profile_and_write(args.gpus, f"{Path(__file__).stem}:profile_job",
                      dict(workload=args.workload, program=args.program, shape_text=args.shape, config=config,
                           calls=args.calls, top=args.top, out_dir=str(args.out_dir.resolve())),
                      args.out_dir / f"profile-{args.workload}-{args.program}-{args.shape}-{args.gpus}gpu.txt", args.calls)


if __name__ == "__main__":
    main()
