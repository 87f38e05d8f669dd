"""Host time per collective call: what a model whose step is host-bound pays for each TACO
collective (device backend) against NCCL's, on W GPUs.

A small message (64 KiB of BF16 by default) keeps the GPU ahead of the host, so the wall time of
`--calls` back-to-back calls divided by their number is the host's cost of issuing one (Python,
argument checks, launches); the GPUs are synchronized only before and after the loop.

    python bench/probe_taco_host.py --gpus 2 [--kib 64] [--calls 300] [--rounds 5] [--out-dir bench/results]

`--profile`: also runs each op's TACO loop under cProfile on rank 0 and writes the 40 functions
with the most own time per op to `probe-taco-host-profile-<W>gpu.txt` in the output folder (where
the host time goes; the timed loops run unprofiled first).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

OPS = ("all_gather", "reduce_scatter", "all_reduce_one_shot", "all_reduce_two_shot")


def host_job(ctx, kib: int, calls: int, fused: bool, profile: bool = False, rounds: int = 5) -> dict:
    """Runs on every rank; rank 0's rows (and profile text) are the answer."""
    import cProfile
    import io
    import pstats

    import torch
    import torch.distributed as dist

    from commweave.taco import collectives as cc
    from commweave.taco.device import DeviceBackend
    from commweave.taco.quant import QuantConfig

    world, cfg = ctx.world_size, QuantConfig()
    n = (kib << 10) // 2 // (world * cfg.group_size) * (world * cfg.group_size)
    full = torch.randn(n, device=ctx.device, dtype=torch.bfloat16)
    shard = full[: n // world].clone()
    backend = DeviceBackend(ctx, fuse_barriers=True) if fused else DeviceBackend(ctx)
    calls_of = {
        "all_gather": (lambda: backend.all_gather(shard, cfg), lambda: cc.all_gather(shard)),
        "reduce_scatter": (lambda: backend.reduce_scatter(full, cfg), lambda: cc.reduce_scatter(full)),
        "all_reduce_one_shot": (lambda: backend.all_reduce(full, cfg, "one_shot"), lambda: cc.all_reduce(full)),
        "all_reduce_two_shot": (lambda: backend.all_reduce(full, cfg, "two_shot"), lambda: cc.all_reduce(full)),
    }

    def host_us(fn) -> float:
        for _ in range(10):
            fn()
        torch.cuda.synchronize(ctx.device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize(ctx.device)
        return elapsed / calls * 1e6

    rows, profiles = [], []
    for op in OPS:
        ours, nccl = calls_of[op]
        timed = {"nccl": [], "taco": []}
        for _ in range(rounds):  # alternated: the host's speed drifts (runs of one op differed by 1.5x)
            timed["nccl"].append(host_us(nccl))
            timed["taco"].append(host_us(ours))
        rows.append({"op": op, "kib": kib, "world": world, "rounds": rounds,
                     "nccl_host_us": statistics.median(timed["nccl"]), "taco_host_us": statistics.median(timed["taco"]),
                     "nccl_rounds_us": timed["nccl"], "taco_rounds_us": timed["taco"]})
        if profile:
            profiler = cProfile.Profile()
            profiler.enable()
            host_us(ours)
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
            profiles.append(f"== {op}: {calls} calls (+10 warm-up) ==\n{text.getvalue()}")
    backend.close()
    ctx.end_candidate()
    return {"rows": rows, "profile": "\n".join(profiles)}


def main() -> None:
    from commweave.report.results import RESULTS_DIR, write_results
    from commweave.runtime import WorkerPool, apply_safe_env

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--kib", type=int, default=64)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5, help="timed loops per op and side, alternated; the median is reported")
    p.add_argument("--fused", action="store_true", help="the reading kernels perform the barrier (fuse_barriers)")
    p.add_argument("--profile", action="store_true", help="also write cProfile's top functions per op (rank 0)")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args()
    apply_safe_env()
    env = {"PYTHONPATH": os.pathsep.join(sys.path)}  # this script's directory: the workers import it by name
    with WorkerPool(args.gpus, device="cuda", job_timeout_s=600, env=env) as pool:
        result = pool.run(f"{Path(__file__).stem}:host_job", kib=args.kib, calls=args.calls, fused=args.fused,
                          profile=args.profile, rounds=args.rounds)
    if not result.ok:
        failure = result.first_failure()
        sys.exit(f"the probe failed: {failure.traceback if failure else result.status}")
    rows = result.values[0]["rows"]
    if args.profile:
        profile_path = args.out_dir / f"probe-taco-host-profile-{args.gpus}gpu.txt"
        profile_path.write_text(result.values[0]["profile"])
        print("profile:", profile_path)
    method = (f"host wall time of {args.calls} back-to-back calls / {args.calls} on rank 0, median of {args.rounds} "
              f"rounds alternating NCCL and TACO, {args.kib} KiB of BF16 "
              "(the GPU keeps ahead of the host), TACO device backend (E4M3, G=128) vs NCCL BF16")
    path = write_results(f"probe-taco-host-{args.gpus}gpu", {"method": method, "fused": args.fused, "rows": rows},
                         command=["python", "bench/probe_taco_host.py", *sys.argv[1:]], out_dir=args.out_dir)
    print(f"{'op':22}{'NCCL µs':>10}{'TACO µs':>10}")
    for r in rows:
        print(f"{r['op']:22}{r['nccl_host_us']:>10.1f}{r['taco_host_us']:>10.1f}")
    print("results:", path)


if __name__ == "__main__":
    main()
