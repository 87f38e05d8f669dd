"""GEMM + ReduceScatter, the pattern of a row-parallel linear layer's forward (and a column-parallel
one's backward) in tensor parallelism (bf16).

A [M, K] is split by columns over W ranks, B [K, N] by rows. Rank r holds A columns
[r*K/W, (r+1)*K/W) as `inputs["a"]` [M, K/W] and the matching B rows as `inputs["b"]` [K/W, N];
its partial product A_r @ B_r is [M, N], and the output is the sum of the W partials, scattered by
rows: rank r gets rows [r*M/W, (r+1)*M/W) as `out` [M/W, N]. The partial a peer owns can be
computed and sent while the rest is still being multiplied, which is what the device-initiated
seed exploits. At W = 1 it is a plain GEMM.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from commweave.contracts.workload import (Cost, Shape, Workload, bf16_product, check_matmul_operands, checked_tensor,
                                          input_names, seeded_generator)

SQUARE_SIZES = (2048, 4096, 8192, 16384)
LLAMA70B_N = 8192  # Llama-3-70B hidden size: the MLP down-projection's output width
LLAMA70B_K = 28672  # Llama-3-70B FFN width: the down-projection's reduction dimension, split over ranks
LLAMA70B_M = (4096, 8192, 16384)  # tokens
_DIMS = re.compile(r"^\s*(-?\d+)\s*[xX]\s*(-?\d+)\s*[xX]\s*(-?\d+)\s*$")
_LLAMA = re.compile(r"^\s*llama70b-M(-?\d+)\s*$")


class GemmReduceScatter(Workload):
    name = "gemm-reducescatter"
    op_inputs = ("a", "b")  # what a caller passes to the op
    summary = "out[M/W, N] = reduce_scatter(A[M, K/W] @ B[K/W, N]) over rows, bf16"
    dtype = torch.bfloat16
    world_sizes = (1, 2, 4, 8)
    baselines = ("host", "torch_async_tp")
    seed = "seed"

    # -- shapes ---------------------------------------------------------------------------------
    def make_shape(self, m: int, n: int, k: int, world_size: int, label: str | None = None) -> Shape:
        """A validated shape; M and K are global (each rank holds K/W columns of A and gets M/W rows)."""
        self.check_world_size(world_size)
        for dim, value in (("M", m), ("N", n), ("K", k)):
            if value <= 0:
                raise ValueError(f"{dim} must be positive, got {value}")
        for dim, value, what in (("M", m, "the output's rows are scattered"), ("K", k, "A's columns and B's rows are split")):
            if value % world_size:
                raise ValueError(f"{dim}={value} is not divisible by the world size {world_size} ({what} evenly over ranks)")
        return Shape(label or f"{m}x{n}x{k}", {"M": m, "N": n, "K": k})

    def llama_shape(self, m: int, world_size: int) -> Shape:
        """Llama-3-70B's MLP down-projection, row-parallel: M tokens, K = FFN 28672, N = hidden 8192."""
        return self.make_shape(m, LLAMA70B_N, LLAMA70B_K, world_size, f"llama70b-M{m}")

    def bench_shapes(self, world_size: int) -> list[Shape]:
        square = [self.make_shape(s, s, s, world_size) for s in SQUARE_SIZES]
        return square + [self.llama_shape(m, world_size) for m in LLAMA70B_M]

    def check_shapes(self, world_size: int) -> list[Shape]:
        # M/W=67, N=203, K/W=37: no dimension fits a tile, and rows of 406 bytes put row blocks and
        # chunks at every even alignment (exercises the reduction's narrower-vector fallbacks).
        return [
            self.make_shape(67 * world_size, 203, 37 * world_size, world_size),
            self.make_shape(1024, 1024, 512, world_size),
        ]

    def parse_shape(self, text: str, world_size: int) -> Shape:
        """'MxNxK' (M and K global) or a Llama label such as 'llama70b-M8192'."""
        llama = _LLAMA.match(text)
        if llama:
            return self.llama_shape(int(llama.group(1)), world_size)
        dims = _DIMS.match(text)
        if not dims:
            raise ValueError(f"shape {text!r} is not 'MxNxK' (e.g. 8192x8192x8192, M and K global) or 'llama70b-M<M>'")
        m, n, k = (int(g) for g in dims.groups())
        return self.make_shape(m, n, k, world_size)

    # -- data -----------------------------------------------------------------------------------
    def make_inputs(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
        gen = seeded_generator(device, seed, world_size, rank)
        m, n, k = shape["M"], shape["N"], shape["K"]
        a = torch.randn(m, k // world_size, generator=gen, device=device, dtype=torch.float32)
        # 1/sqrt(K) with the global K: the sum over all ranks' partials has entries of O(1)
        b = torch.randn(k // world_size, n, generator=gen, device=device, dtype=torch.float32) / math.sqrt(k)
        return {"a": a.to(self.dtype), "b": b.to(self.dtype)}

    def make_output(self, shape: Shape, world_size: int, rank: int, device: torch.device) -> torch.Tensor:
        return torch.empty(shape["M"] // world_size, shape["N"], dtype=self.dtype, device=device)

    def reference(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> torch.Tensor:
        """Every rank's partial of this rank's row block, from regenerated inputs, summed in fp32 in rank order."""
        rows = shape["M"] // world_size
        block = slice(rank * rows, (rank + 1) * rows)
        total = torch.zeros(rows, shape["N"], dtype=torch.float32, device=device)
        for r in range(world_size):
            x = self.make_inputs(shape, world_size, r, seed, device)
            total += bf16_product(x["a"][block], x["b"])
        return total

    def cost(self, shape: Shape, world_size: int) -> Cost:
        m, n, k_local = shape["M"], shape["N"], shape["K"] // world_size
        rows = m // world_size
        item = torch.empty((), dtype=self.dtype).element_size()
        return Cost(
            flops=2.0 * m * n * k_local,
            comm_bytes=float((world_size - 1) * rows * n * item),  # every peer's partial of this rank's rows
            memory_bytes=float((m * k_local + k_local * n + rows * n) * item),
            wire_ratio=self.wire_ratio(n, item),
        )

    def template(self):
        from commweave.workloads.gemm_reducescatter.template import GemmReduceScatterTemplate

        return GemmReduceScatterTemplate(self)

    # -- calls on a user's tensors (commweave.ops) ---------------------------------------------
    def single_rank(self, inputs: Mapping[str, torch.Tensor | None], out: torch.Tensor | None = None,
                    **options: Any) -> torch.Tensor:
        """One rank holds all of K: the product, nothing to reduce."""
        check_matmul_operands(inputs["a"], inputs["b"])
        return inputs["a"] @ inputs["b"]

    def shape_from_inputs(self, inputs: Mapping[str, torch.Tensor], world_size: int, rank: int,
                          out: torch.Tensor | None = None) -> Shape:
        """a [M, K/W] (this rank's columns of A) and b [K/W, N] (its rows of B), bf16, one device."""
        input_names(inputs, ("a", "b"))
        a = checked_tensor("a", inputs["a"], 2, self.dtype)
        b = checked_tensor("b", inputs["b"], 2, self.dtype, a.device)
        if a.shape[1] != b.shape[0]:
            raise ValueError(f"a [M, K/W] has K/W={a.shape[1]} columns, but b [K/W, N] has {b.shape[0]} rows")
        return self.make_shape(a.shape[0], b.shape[1], a.shape[1] * world_size, world_size)
