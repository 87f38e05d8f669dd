"""Column- and row-parallel linear layers whose communication is commweave's fused ops.

Sequence parallelism (Megatron): activations between blocks are sharded by rows (tokens) over
the tensor-parallel group. The column-parallel layer all-gathers its input rows and multiplies
by its shard of the weight's output features (`gemm_allgather`); the row-parallel layer
multiplies its shard of the input features and reduce-scatters the partial sums back to rows
(`gemm_reducescatter`). Weights are stored as torch.nn.Linear stores them ([out, in]), each rank
holding its shard; neither layer has a bias (a replicated bias of the row-parallel layer would
need its gradient all-reduced over the group: add it outside).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from commweave.ops.groups import GroupLike, group_name, group_rank, group_size
from commweave.ops.runner import ProgramSpec


class _ShardedLinear(nn.Module):
    """A linear layer holding one shard of a [out_features, in_features] weight along `dim`."""

    dim: int  # 0: output features sharded (column-parallel); 1: input features (row-parallel)

    def __init__(self, in_features: int, out_features: int, group: GroupLike = None, program: ProgramSpec = None,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.group = group_name(group)
        self.world_size, self.rank = group_size(self.group), group_rank(self.group)
        # One rank has nothing to communicate: the layer is then torch.nn.Linear's own F.linear
        # (the same kernels in forward and backward), not the custom op, whose dispatch and Python
        # backward would only add host time to a step that may be launch-bound. A named program
        # still goes through the op, which looks it up (a wrong name fails on any W).
        self.alone = self.world_size == 1 and program is None
        self.in_features, self.out_features = in_features, out_features
        self.program = None if program is None else str(program)
        full = [out_features, in_features]
        if full[self.dim] % self.world_size:
            what = ("out_features", "in_features")[self.dim]
            raise ValueError(f"{what}={full[self.dim]} is not divisible by the group's {self.world_size} ranks")
        full[self.dim] //= self.world_size
        self.weight = nn.Parameter(torch.empty(full, device=device, dtype=dtype))
        bound = 1.0 / math.sqrt(in_features)  # torch.nn.Linear's default, for the whole matrix
        nn.init.uniform_(self.weight, -bound, bound)

    def shard_of(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full [out_features, in_features] weight (a view)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"a full weight is [{self.out_features}, {self.in_features}], got {tuple(weight.shape)}")
        return weight.chunk(self.world_size, dim=self.dim)[self.rank]

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        """Copy this rank's shard of a full [out_features, in_features] weight into the layer."""
        self.weight.copy_(self.shard_of(weight))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={self.group!r} "
                f"(rank {self.rank} of {self.world_size})")


class ColumnParallelLinear(_ShardedLinear):
    """y [T, out/W] = all_gather(x [T/W, in]) @ W_shard^T, the gather hidden behind the GEMM
    (`commweave.ops.gemm_allgather`); weight [out/W, in]. On one rank, `F.linear` (see
    `_ShardedLinear.alone`)."""

    dim = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.alone:
            return F.linear(x, self.weight)
        return torch.ops.commweave.gemm_allgather(x, self.weight.t(), self.group, self.program)


class RowParallelLinear(_ShardedLinear):
    """y [T/W, out] = reduce_scatter(x [T, in/W] @ W_shard^T) over rows
    (`commweave.ops.gemm_reducescatter`); weight [out, in/W]. On one rank, `F.linear`."""

    dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.alone:
            return F.linear(x, self.weight)
        return torch.ops.commweave.gemm_reducescatter(x, self.weight.t(), self.group, self.program)
