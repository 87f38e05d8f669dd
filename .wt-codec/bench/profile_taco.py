"""Where a TACO device-backend collective's time goes: profile `--calls` calls of one collective of
`--mib` MiB (BF16, E4M3, G=128) on the GPUs with torch.profiler and print rank 0's table, CPU and
CUDA time side by side (a call that is slow on the host shows as CPU time, not kernel time), then
the GPU timeline of one more call queued behind a hold (as the bandwidth table times it): each
kernel's start and duration in µs from the end of the barrier that lines the ranks up, so the gaps
between kernels show where a call's fixed cost goes.

    python bench/profile_taco.py --gpus 2 --op all_gather --mib 16
"""

from __future__ import annotations

import argparse
from pathlib import Path

from profile_program import profile_and_write  # bench/ is on sys.path when this runs as a script

OPS = ("all_gather", "reduce_scatter", "one_shot", "two_shot")


def profile_job(ctx, op: str, mib: int, calls: int, top: int, fused: bool = False) -> str:
    """Runs inside each worker: warm up, then profile `calls` calls; rank 0 returns the table."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from commweave.taco.device import DeviceBackend
    from commweave.taco.quant import QuantConfig

    backend = DeviceBackend(ctx, fuse_barriers=fused)
    cfg = QuantConfig(128)
    n = (mib << 20) // 2
    full = torch.randn(n, device=ctx.device, dtype=torch.bfloat16)
    shard = full[: n // ctx.world_size].clone()
    call = {"all_gather": lambda: backend.all_gather(shard, cfg),
            "reduce_scatter": lambda: backend.reduce_scatter(full, cfg),
            "one_shot": lambda: backend.all_reduce(full, cfg, "one_shot"),
            "two_shot": lambda: backend.all_reduce(full, cfg, "two_shot")}[op]
    for _ in range(3):
        call()
    ctx.synchronize()
    ctx.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        ctx.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60)
    table += "\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60)
    table += "\n" + gated_timeline(ctx, call)
    backend.close()
    ctx.end_candidate()
    return table


def gated_timeline(ctx, call) -> str:
    """One call queued behind `ctx.hold_stream` after a device barrier (`timing.gated_seconds`'s
    order), profiled: its GPU work (kernels, copies, memsets) in order, times from the barrier's end."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        release = ctx.hold_stream()
        ctx.device_barrier()
        call()
        release()
        ctx.synchronize()
    gpu = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    gate = max(i for i, e in enumerate(gpu) if "gate" in e.name)  # the hold's kernel, then the lining-up barrier
    barrier = next(i for i in range(gate + 1, len(gpu)) if "barrier" in gpu[i].name)
    t0 = gpu[barrier].time_range.end
    lines = [f"gated call, GPU timeline (µs from the lining-up barrier's end; {len(gpu) - barrier - 1} items):",
             f"{'start':>9}{'dur':>9}{'gap':>8}  name"]
    end = t0
    for e in gpu[barrier + 1:]:
        lines.append(f"{e.time_range.start - t0:>9.1f}{e.time_range.elapsed_us():>9.1f}"
                     f"{e.time_range.start - end:>8.1f}  {e.name[:90]}")
        end = max(end, e.time_range.end)
    lines.append(f"total {end - t0:.1f} µs")
    torch.cuda.synchronize()
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--op", choices=OPS, default="all_gather")
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--fused", action="store_true", help="the reading kernels perform the barrier (fuse_barriers)")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/logs"))
    args = parser.parse_args()
    profile_and_write(args.gpus, f"{Path(__file__).stem}:profile_job",
                      dict(op=args.op, mib=args.mib, calls=args.calls, top=args.top, fused=args.fused),
                      args.out_dir / f"profile-taco-{args.op}-{args.mib}MiB-{args.gpus}gpu{'-fused' if args.fused else ''}.txt",
                      args.calls)


if __name__ == "__main__":
    main()
