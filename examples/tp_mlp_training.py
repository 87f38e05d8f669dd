"""Training steps of a tensor-parallel MLP built with commweave.nn, on CPU ranks over gloo.

    torchrun --standalone --nproc-per-node 2 examples/tp_mlp_training.py

A Megatron-style MLP block, sequence parallel in and out: each rank holds T/W rows (tokens) of the
activations; `ColumnParallelLinear` all-gathers them inside its GEMM (commweave's gemm_allgather
op) and `RowParallelLinear` reduce-scatters its partial sums back to rows (gemm_reducescatter).
The block learns to map random inputs to the outputs of a fixed random "teacher" MLP with plain
SGD. Before training, the block's output is compared with one unsharded float32 MLP of the same
weights, so the sharding is seen to compute the same function. On GPUs the same code runs the
device-initiated programs (`device="cuda"`, an NCCL process group); on CPU each op says once (a
RuntimeWarning) that its seed needs GPUs and runs its host program over gloo instead.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from commweave.nn import ColumnParallelLinear, RowParallelLinear

HIDDEN, FFN, TOKENS, STEPS, LR = 64, 256, 32, 30, 0.5


def main() -> int:
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)  # every rank draws the same full weights and data, then keeps its shard
    w_up, w_down = torch.randn(FFN, HIDDEN) / HIDDEN**0.5, torch.randn(HIDDEN, FFN) / FFN**0.5
    teacher_up, teacher_down = torch.randn(FFN, HIDDEN) / HIDDEN**0.5, torch.randn(HIDDEN, FFN) / FFN**0.5
    x = torch.randn(TOKENS, HIDDEN)
    target = F.gelu(x @ teacher_up.t()) @ teacher_down.t()

    up = ColumnParallelLinear(HIDDEN, FFN, group=dist.group.WORLD)  # weight shard [FFN/W, HIDDEN], bf16
    down = RowParallelLinear(FFN, HIDDEN, group=dist.group.WORLD)  # weight shard [HIDDEN, FFN/W]
    up.load_full(w_up)
    down.load_full(w_down)
    rows = slice(rank * TOKENS // world, (rank + 1) * TOKENS // world)  # this rank's tokens
    x_mine, target_mine = x[rows].bfloat16(), target[rows]

    y = down(F.gelu(up(x_mine)))
    plain = (F.gelu(x @ w_up.t()) @ w_down.t())[rows]
    error = ((y.float() - plain).norm() / plain.norm()).item()
    say(rank, f"{world} ranks: the sharded block's output is {error:.1e} (relative) from one unsharded float32 MLP")

    optimizer = torch.optim.SGD([up.weight, down.weight], lr=LR)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        y = down(F.gelu(up(x_mine)))
        loss = F.mse_loss(y.float(), target_mine, reduction="sum") / (TOKENS * HIDDEN)
        loss.backward()  # the weights' gradients are this rank's shards: nothing to all-reduce
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)  # every rank's tokens
        losses.append(total.item())
        if step % 10 == 0 or step == STEPS - 1:
            say(rank, f"step {step:2d}: loss {losses[-1]:.4f}")
    say(rank, f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {STEPS} steps")
    dist.destroy_process_group()
    return 0 if error < 2e-2 and losses[-1] < 0.8 * losses[0] else 1


def say(rank: int, line: str) -> None:
    if rank == 0:
        print(line, flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
