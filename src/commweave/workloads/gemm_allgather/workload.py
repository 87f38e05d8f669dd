"""GEMM + AllGather, the tensor-parallel pattern of a column-parallel linear layer (bf16).

A [M, K] is split by rows over W ranks, B [K, N] by columns. Rank r holds A rows
[r*M/W, (r+1)*M/W) as `inputs["a"]` [M/W, K] and B columns as `inputs["b"]` [K, N/W]; it must
produce `out` [M, N/W] = all_gather(A) @ B_local. Communication (gathering A) can overlap the GEMM
row block by row block, which is what the device-initiated seed exploits. At W = 1 there is
nothing to gather: every program is its GEMM (the compute side alone, what overlap must hide).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from commweave.contracts.workload import (LOSSY_TOLERANCE, Cost, Shape, Workload, bf16_product, check_matmul_operands,
                                          checked_tensor, input_names, seeded_generator)

SQUARE_SIZES = (2048, 4096, 8192, 16384)
LLAMA70B_N_LOCAL = 3584  # Llama-3-70B MLP up-projection (28672 wide) split over 8, per rank
LLAMA70B_K = 8192  # Llama-3-70B hidden size
LLAMA70B_M = (4096, 8192, 16384)
_DIMS = re.compile(r"^\s*(-?\d+)\s*[xX]\s*(-?\d+)\s*[xX]\s*(-?\d+)\s*$")
_LLAMA = re.compile(r"^\s*llama70b-M(-?\d+)\s*$")


class GemmAllGather(Workload):
    name = "gemm-allgather"
    op_inputs = ("a", "b")  # what a caller passes to the op
    summary = "out[M, N/W] = all_gather(A rows)[M, K] @ B[K, N/W], bf16"
    dtype = torch.bfloat16
    world_sizes = (1, 2, 4)
    baselines = ("host", "torch_async_tp")
    seed = "seed"

    # -- shapes ---------------------------------------------------------------------------------
    def make_shape(self, m: int, n: int, k: int, world_size: int, label: str | None = None) -> Shape:
        """A validated shape; N is global (each rank computes N/W columns)."""
        self.check_world_size(world_size)
        for dim, value in (("M", m), ("N", n), ("K", k)):
            if value <= 0:
                raise ValueError(f"{dim} must be positive, got {value}")
        for dim, value, what in (("M", m, "A's rows"), ("N", n, "B's columns")):
            if value % world_size:
                raise ValueError(f"{dim}={value} is not divisible by the world size {world_size} ({what} are split evenly over ranks)")
        return Shape(label or f"{m}x{n}x{k}", {"M": m, "N": n, "K": k})

    def bench_shapes(self, world_size: int) -> list[Shape]:
        square = [self.make_shape(s, s, s, world_size) for s in SQUARE_SIZES]
        llama = [self.make_shape(m, LLAMA70B_N_LOCAL * world_size, LLAMA70B_K, world_size, f"llama70b-M{m}") for m in LLAMA70B_M]
        return square + llama

    def check_shapes(self, world_size: int) -> list[Shape]:
        # K=203: rows of 406 bytes, so shard and chunk starts fall on every alignment from 2 to 16
        # bytes (exercises the 16-byte vector copy's fallbacks); M/W=67 and N/W=72 fit no tile.
        return [
            self.make_shape(67 * world_size, 72 * world_size, 203, world_size),
            self.make_shape(1024, 1024, 512, world_size),
        ]

    def parse_shape(self, text: str, world_size: int) -> Shape:
        """'MxNxK' (N global) or a Llama label such as 'llama70b-M8192'."""
        llama = _LLAMA.match(text)
        if llama:
            m = int(llama.group(1))
            return self.make_shape(m, LLAMA70B_N_LOCAL * world_size, LLAMA70B_K, world_size, f"llama70b-M{m}")
        dims = _DIMS.match(text)
        if not dims:
            raise ValueError(f"shape {text!r} is not 'MxNxK' (e.g. 8192x8192x8192, N global) or 'llama70b-M<M>'")
        m, n, k = (int(g) for g in dims.groups())
        return self.make_shape(m, n, k, world_size)

    # -- data -----------------------------------------------------------------------------------
    def make_inputs(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
        gen = seeded_generator(device, seed, world_size, rank)
        m_local, k, n_local = shape["M"] // world_size, shape["K"], shape["N"] // world_size
        a = torch.randn(m_local, k, generator=gen, device=device, dtype=torch.float32)
        b = torch.randn(k, n_local, generator=gen, device=device, dtype=torch.float32) / math.sqrt(k)
        return {"a": a.to(self.dtype), "b": b.to(self.dtype)}

    def make_output(self, shape: Shape, world_size: int, rank: int, device: torch.device) -> torch.Tensor:
        return torch.empty(shape["M"], shape["N"] // world_size, dtype=self.dtype, device=device)

    def reference(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> torch.Tensor:
        a_full = torch.cat([self.make_inputs(shape, world_size, r, seed, device)["a"] for r in range(world_size)])
        b = self.make_inputs(shape, world_size, rank, seed, device)["b"]
        return bf16_product(a_full, b)

    def cost(self, shape: Shape, world_size: int) -> Cost:
        m, k, n_local = shape["M"], shape["K"], shape["N"] // world_size
        item = torch.empty((), dtype=self.dtype).element_size()
        return Cost(
            flops=2.0 * m * n_local * k,
            comm_bytes=(world_size - 1) / world_size * m * k * item,
            memory_bytes=float((m * k + k * n_local + m * n_local) * item),
            wire_ratio=self.wire_ratio(k, item),
        )

    def template(self):
        from commweave.workloads.gemm_allgather.template import GemmAllGatherTemplate

        return GemmAllGatherTemplate(self)

    # -- calls on a user's tensors (commweave.ops) ---------------------------------------------
    def single_rank(self, inputs: Mapping[str, torch.Tensor | None], out: torch.Tensor | None = None,
                    **options: Any) -> torch.Tensor:
        """One rank holds all of A and B: the product."""
        check_matmul_operands(inputs["a"], inputs["b"])
        return inputs["a"] @ inputs["b"]

    def shape_from_inputs(self, inputs: Mapping[str, torch.Tensor], world_size: int, rank: int,
                          out: torch.Tensor | None = None) -> Shape:
        """a [M/W, K] (this rank's rows of A) and b [K, N/W] (its columns of B), bf16, one device."""
        input_names(inputs, ("a", "b"))
        a = checked_tensor("a", inputs["a"], 2, self.dtype)
        b = checked_tensor("b", inputs["b"], 2, self.dtype, a.device)
        if a.shape[1] != b.shape[0]:
            raise ValueError(f"a [M/W, K] has K={a.shape[1]} columns, but b [K, N/W] has {b.shape[0]} rows")
        return self.make_shape(a.shape[0] * world_size, b.shape[1] * world_size, a.shape[1], world_size)


class GemmAllGatherLossy(GemmAllGather):
    """The same computation for a caller who accepts a lossy gather of A, as tensor-parallel
    training does with activations (TACO's setting): a declared tolerance of 4 % relative error,
    so the design space admits FP8 E4M3 compression of the gathered rows (not E5M2). Every program
    of gemm-allgather runs unchanged; the search may now pick the compressed one."""

    name = "gemm-allgather-lossy"
    summary = "gemm-allgather accepting 4% relative error: FP8 (TACO) compression of A admitted"

    def tolerance(self) -> float:
        return LOSSY_TOLERANCE

