"""Judging a program: the judge checks a program against a workload's reference, then times it
beside the workload's baseline, on two CPU workers (gloo), no GPU needed.

    python examples/judge_a_program.py

The program computes gemm-allgather (out[M, N/W] = all_gather(A rows) @ B[K, N/W]) in the program
format: setup() once, run() every call, between EVOLVE-BLOCK markers. Instead of one all-gather and
then one GEMM (the workload's host baseline), it gathers one shard at a time with broadcasts and
multiplies each shard as it arrives. A second copy with a bug (one shard multiplied twice) shows
what the judge says about a wrong program. On a CPU this is a dry run of the judge: its timings
only tell the two programs' host costs apart, not what a GPU would do.
"""

from __future__ import annotations

import sys

from commweave.evaluate import Evaluator
from commweave.runtime import WorkerPool
from commweave.workloads import get_workload

PROGRAM = '''
import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    """One receive buffer per rank's shard of A, allocated once."""
    rows = shape["M"] // ctx.world_size
    return {"shards": [torch.empty(rows, shape["K"], dtype=torch.bfloat16, device=ctx.device)
                       for _ in range(ctx.world_size)]}


def run(ctx, state, inputs, out):
    """Shard by shard: broadcast rank r's rows of A, multiply them into out's rows of rank r."""
    rows = inputs["a"].shape[0]
    for r, shard in enumerate(state["shards"]):
        if r == ctx.rank:
            shard.copy_(inputs["a"])
        dist.broadcast(shard, src=dist.get_global_rank(ctx.group, r), group=ctx.group)
        torch.matmul(shard, inputs["b"], out=out[r * rows:(r + 1) * rows])
# EVOLVE-BLOCK-END
'''

BUGGY = PROGRAM.replace("torch.matmul(shard,", "torch.matmul(state['shards'][0],")


def main() -> int:
    workload = get_workload("gemm-allgather")
    shape = workload.parse_shape("256x256x256", 2)
    with WorkerPool(2, device="cpu", job_timeout_s=120) as pool:
        judge = Evaluator(pool, workload, warmup=2, iters=20)
        wrong = judge.check(BUGGY)
        print(f"buggy program: {wrong.failure.value if wrong.failure else 'passed'}: {wrong.message}")
        result = judge.evaluate(PROGRAM, shape)
        print(f"program: {result.verdict.message}")
        if not result.verdict.ok:
            return 1
        for name, timing in result.baselines.items():
            said = f"{timing.median_us:,.0f} µs" if timing.verdict.ok else f"{timing.verdict.failure.value}"
            print(f"baseline {name}: {said}")
        print(f"program at {shape}: {result.candidate.median_us:,.0f} µs, {result.fitness:.2f}x the "
              f"{result.baseline} baseline (CPU workers: a dry run, not a GPU measurement)")
    return 0 if wrong.failure is not None else 1


if __name__ == "__main__":
    sys.exit(main())
