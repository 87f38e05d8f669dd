"""Megatron-style tensor-parallel Linear layers with sequence parallelism over compressed collectives.

Layout (sequence parallelism, activations [seq, batch, hidden], sequence first as in Megatron):

  ColumnParallelLinear  input  [s/world, b, in]   --all-gather(seq)-->  [s, b, in]
                        weight [out/world, in]    output [s, b, out/world]
                        backward: input grad [s, b, in] --reduce-scatter(seq)--> [s/world, b, in]
  RowParallelLinear     input  [s, b, in/world]   weight [out, in/world]
                        output partial [s, b, out] --reduce-scatter(seq)--> [s/world, b, out] (+bias)
                        backward: output grad [s/world, b, out] --all-gather(seq)--> [s, b, out]

Each layer takes `compression` (a QuantConfig for the forward collective, None for the plain torch
collective) and `grad_compression` for its backward mirror (defaults to `compression`), so
compression is switchable per layer and per direction. The collectives are
commweave.taco.collectives, through its `backend` argument: "reference" (torch.distributed),
"device" (device-initiated over symmetric windows; CUDA graph capture works after a warm-up
call), or "auto" (the measured per-size choice).

`group` is the TP group: a ProcessGroup, or a DeviceMesh and its TP dimension as (mesh, dim) (a
one-dimensional mesh alone also does); default, every rank.

Parameters whose gradient is computed from this rank's sequence shard only (RowParallelLinear's
bias, replicated on every rank) carry `sequence_parallel = True`; as in Megatron, their gradients
must be all-reduced over the TP group: allreduce_sequence_parallel_grads() does it.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from commweave.taco import collectives as cc
from commweave.taco.backend import Group, resolve_group
from commweave.taco.quant import QuantConfig

_SAME = object()  # grad_compression default: the forward's setting


class _GatherFromSequenceParallel(torch.autograd.Function):
    """Forward: all-gather along dim 0. Backward: reduce-scatter along dim 0."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cfg: QuantConfig | None, grad_cfg: QuantConfig | None, group: Any,
                backend: str) -> torch.Tensor:
        ctx.grad_cfg, ctx.group, ctx.backend = grad_cfg, group, backend
        return cc.all_gather(x, cfg, group, backend)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return cc.reduce_scatter(grad, ctx.grad_cfg, ctx.group, ctx.backend), None, None, None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Forward: reduce-scatter along dim 0. Backward: all-gather along dim 0."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cfg: QuantConfig | None, grad_cfg: QuantConfig | None, group: Any,
                backend: str) -> torch.Tensor:
        ctx.grad_cfg, ctx.group, ctx.backend = grad_cfg, group, backend
        return cc.reduce_scatter(x, cfg, group, backend)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return cc.all_gather(grad, ctx.grad_cfg, ctx.group, ctx.backend), None, None, None, None


def gather_from_sequence_parallel(x: torch.Tensor, compression: QuantConfig | None = None, grad_compression: Any = _SAME,
                                  group: Group = None, backend: str = "reference") -> torch.Tensor:
    grad_cfg = compression if grad_compression is _SAME else grad_compression
    return _GatherFromSequenceParallel.apply(x, compression, grad_cfg, resolve_group(group), backend)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, compression: QuantConfig | None = None,
                                        grad_compression: Any = _SAME, group: Group = None,
                                        backend: str = "reference") -> torch.Tensor:
    grad_cfg = compression if grad_compression is _SAME else grad_compression
    return _ReduceScatterToSequenceParallel.apply(x, compression, grad_cfg, resolve_group(group), backend)


class _TPLinear(nn.Module):
    def __init__(self, compression: QuantConfig | None, grad_compression: Any, group: Group, backend: str):
        super().__init__()
        self.group = resolve_group(group)
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.compression = compression
        self.grad_compression = compression if grad_compression is _SAME else grad_compression
        self.backend = backend

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, world={self.world_size}, "
                f"compression={self.compression}, grad_compression={self.grad_compression}")


class ColumnParallelLinear(_TPLinear):
    """y[:, :, shard] = all_gather_seq(x) @ W[shard].T + b[shard]; weight split along out_features."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, compression: QuantConfig | None = None,
                 grad_compression: Any = _SAME, group: Group = None, backend: str = "reference",
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__(compression, grad_compression, group, backend)
        if out_features % self.world_size:
            raise ValueError(f"out_features={out_features} is not divisible by the TP size {self.world_size}")
        self.in_features, self.out_features = in_features, out_features
        local = out_features // self.world_size
        self.weight = nn.Parameter(torch.empty(local, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(local, dtype=dtype, device=device)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    @torch.no_grad()
    def load_full_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Take this rank's rows of an unsharded [out, in] weight (and [out] bias)."""
        local = self.out_features // self.world_size
        self.weight.copy_(weight[self.rank * local:(self.rank + 1) * local])
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias[self.rank * local:(self.rank + 1) * local])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = gather_from_sequence_parallel(x, self.compression, self.grad_compression, self.group, self.backend)
        return nn.functional.linear(total, self.weight, self.bias)


class RowParallelLinear(_TPLinear):
    """y_seq_shard = reduce_scatter_seq(x @ W[:, shard].T) + b; weight split along in_features."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, compression: QuantConfig | None = None,
                 grad_compression: Any = _SAME, group: Group = None, backend: str = "reference",
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__(compression, grad_compression, group, backend)
        if in_features % self.world_size:
            raise ValueError(f"in_features={in_features} is not divisible by the TP size {self.world_size}")
        self.in_features, self.out_features = in_features, out_features
        local = in_features // self.world_size
        self.weight = nn.Parameter(torch.empty(out_features, local, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        if self.bias is not None:
            self.bias.sequence_parallel = True  # grad from this rank's sequence shard only
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    @torch.no_grad()
    def load_full_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Take this rank's columns of an unsharded [out, in] weight (and the whole [out] bias)."""
        local = self.in_features // self.world_size
        self.weight.copy_(weight[:, self.rank * local:(self.rank + 1) * local])
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = nn.functional.linear(x, self.weight)
        out = reduce_scatter_to_sequence_parallel(partial, self.compression, self.grad_compression, self.group,
                                                  self.backend)
        return out if self.bias is None else out + self.bias


def allreduce_sequence_parallel_grads(modules: Iterable[nn.Module], group: Group = None) -> None:
    """Sum over the TP group the gradients of parameters marked `sequence_parallel` (uncompressed:
    they are small)."""
    group = resolve_group(group)
    for module in modules:
        for p in module.parameters():
            if getattr(p, "sequence_parallel", False) and p.grad is not None:
                dist.all_reduce(p.grad, group=group)
