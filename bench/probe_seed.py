"""Where the gemm-allgather seed's time goes: host enqueue vs GPU time of its parts, on the GPU machine.

    python bench/probe_seed.py --gpus 4 --shapes 4096x4096x4096 8192x8192x8192 --config comm_ctas=8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from commweave.contracts.program import load_program, with_config
from commweave.report.results import write_results
from commweave.runtime import WorkerPool, apply_safe_env
from commweave.workloads import get_workload


def _measure(ctx, fn, iters: int) -> dict[str, float]:
    host, gpu = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        ctx.barrier()
        ctx.device_barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e6)
        gpu.append(start.elapsed_time(end) * 1e3)
    return {"host_us": statistics.median(host), "gpu_us": statistics.median(gpu)}


def job(ctx, shape_text: str, config: dict, iters: int = 20) -> dict:
    wl = get_workload("gemm-allgather")
    shape = wl.parse_shape(shape_text, ctx.world_size)
    program = load_program(with_config(wl.program_text("seed"), **config), "probe")
    state = program.setup(ctx, shape)
    inputs = wl.make_inputs(shape, ctx.world_size, ctx.rank, 1, ctx.device)
    out = wl.make_output(shape, ctx.world_size, ctx.rank, ctx.device)
    a, b = inputs["a"], inputs["b"]
    main, comm = torch.cuda.current_stream(), state["stream"]
    row_bytes = a.shape[1] * a.element_size()

    def push() -> None:
        comm.wait_stream(main)
        state["push"].launch(state["ctas"], program.CONFIG["threads"], [
            a, state["a_win"], state["a_win"].offset, state["flag_win"], state["flag_win"].offset,
            state["rows"], row_bytes, state["chunks"], int(program.CONFIG["order"] == "staggered"), state["dc"],
        ], stream=comm)
        state["flags"].zero_()
        main.wait_stream(comm)

    rows = state["rows"]
    own = slice(ctx.rank * rows, (ctx.rank + 1) * rows)
    parts = {
        "run": lambda: program.run(ctx, state, inputs, out),
        "push_only": push,
        "gemm_local_shard": lambda: torch.matmul(a, b, out=out[own]),
        "gemm_full_M": lambda: torch.matmul(state["a_full"], b, out=out),
        "wait_kernel_launch": lambda: state["wait"].launch(1, 1, [state["flags"], 0, 0], stream=main),
    }
    for _ in range(3):
        program.run(ctx, state, inputs, out)
    result = {name: _measure(ctx, fn, iters) for name, fn in parts.items()}
    pushed = (ctx.world_size - 1) * a.numel() * a.element_size()
    result["push_GBps"] = pushed / (result["push_only"]["gpu_us"] * 1e-6) / 1e9
    ctx.end_candidate()
    return result


def main() -> None:
    apply_safe_env()
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--shapes", nargs="+", default=["4096x4096x4096", "8192x8192x8192"])
    parser.add_argument("--config", action="append", default=[], help="knob=value")
    args = parser.parse_args()
    config = {}
    for item in args.config:
        k, _, v = item.partition("=")
        config[k] = int(v) if v.lstrip("-").isdigit() else {"true": True, "false": False}.get(v, v)
    report = {}
    with WorkerPool(args.gpus, job_timeout_s=300) as pool:
        for shape in args.shapes:
            r = pool.run("probe_seed:job", shape_text=shape, config=config)
            if not r.ok:
                print(shape, r.first_failure())
                continue
            report[shape] = r.values
            print(shape, json.dumps(r.values[0], indent=1))
    path = write_results(f"probe-gemm-allgather-seed-{args.gpus}gpu", {"config": config, "report": report},
                         command=["python", "bench/probe_seed.py", *sys.argv[1:]], out_dir=Path(__file__).parent / "results")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
