"""Host time of one kernel launch through `runtime.launch.Kernel` against the driver call alone and a
torch op, on one GPU: what each of a per-call collective's launches costs the host.

    python bench/probe_launch.py [--launches 5000] [--out-dir bench/results]

An empty kernel with the argument list of TACO's compress (ten scalars and pointers) is launched
`--launches` times back to back (the GPU keeps ahead), five alternated rounds; medians of µs a launch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

SOURCE = r"""
extern "C" __global__ void probe_empty(const void* x, long long numel, long long stride, int segments, void* buf,
                                       long long buf_stride, int vec, int skip, void* own, int own_vec) {}
"""


def main() -> None:
    from cuda.bindings import driver as drv

    from commweave.report.results import RESULTS_DIR, write_results
    from commweave.runtime.compile import compile_cubin
    from commweave.runtime.launch import Module

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args()
    x = torch.zeros(1024, device="cuda")  # first: torch makes the primary context the module loads into
    buf = torch.zeros(1024, dtype=torch.uint8, device="cuda")
    kernel = Module(compile_cubin(SOURCE).path, "probe").kernel("probe_empty")
    call_args = [x, 1024, 1024, 1, buf, 1024, 1, -1, 0, 1]
    # the driver call alone: arguments packed once, the stream handle once
    kernel.launch(1, 256, call_args)
    stream = drv.CUstream(torch.cuda.current_stream().cuda_stream)
    pointers = kernel._pointers_address

    def runtime_launch() -> None:
        kernel.launch(1, 256, call_args)

    def driver_only() -> None:
        drv.cuLaunchKernel(kernel.function, 1, 1, 1, 256, 1, 1, 0, stream, pointers, 0)

    def torch_op() -> None:
        x.add_(1.0)

    sides = {"runtime Kernel.launch": runtime_launch, "cuLaunchKernel alone": driver_only, "torch x.add_(1)": torch_op}
    timed: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, fn in sides.items():
            for _ in range(100):
                fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.launches):
                fn()
            timed[name].append((time.perf_counter() - start) / args.launches * 1e6)
            torch.cuda.synchronize()
    rows = [{"what": name, "host_us": statistics.median(v), "rounds_us": v} for name, v in timed.items()]
    path = write_results("probe-launch-1gpu", {"method": f"{args.launches} back-to-back launches, median of {args.rounds} "
                                               "alternated rounds, host wall time per launch", "rows": rows},
                         command=["python", "bench/probe_launch.py", *sys.argv[1:]], out_dir=args.out_dir)
    for r in rows:
        print(f"{r['what']:24} {r['host_us']:7.2f} µs")
    print("results:", path)


if __name__ == "__main__":
    main()
