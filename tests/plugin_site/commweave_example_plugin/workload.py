"""all-reduce + RMSNorm: the tail of a row-parallel layer, written as a third-party plugin.

Rank r holds x_r [T, H], its partial sum of the layer's output, and the norm's weight g [H];
every rank gets out = rmsnorm(sum_r x_r) * g [T, H]. Float32, so it runs on CPU over gloo.
It has a host program only: its op and its evaluation run that.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from commweave.contracts.workload import Cost, Shape, Workload, checked_tensor, input_names, seeded_generator

EPS = 1e-6
_DIMS = re.compile(r"^(\d+)x(\d+)$")


def rmsnorm(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * g


class AllReduceRMSNorm(Workload):
    name = "allreduce-rmsnorm"
    summary = "out = rmsnorm(all_reduce(x)) * g, float32 (an example plugin)"
    dtype = torch.float32
    world_sizes = (1, 2, 4)
    baselines = ("host",)
    seed = "host"  # no device-initiated program yet
    op_inputs = ("x", "g")

    def make_shape(self, tokens: int, hidden: int) -> Shape:
        return Shape(f"{tokens}x{hidden}", {"T": tokens, "H": hidden})

    def bench_shapes(self, world_size: int) -> list[Shape]:
        return [self.make_shape(64, 256)]

    def check_shapes(self, world_size: int) -> list[Shape]:
        return [self.make_shape(3, 10), self.make_shape(16, 64)]

    def parse_shape(self, text: str, world_size: int) -> Shape:
        match = _DIMS.match(text.strip())
        if not match:
            raise ValueError(f"shape {text!r} is not 'TxH' (tokens x hidden)")
        return self.make_shape(*(int(g) for g in match.groups()))

    def make_inputs(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
        gen = seeded_generator(torch.device("cpu"), seed, rank)
        x = torch.randn(shape["T"], shape["H"], generator=gen)
        g = 1 + 0.1 * torch.randn(shape["H"], generator=seeded_generator(torch.device("cpu"), seed))
        return {"x": x.to(device), "g": g.to(device)}

    def make_output(self, shape: Shape, world_size: int, rank: int, device: torch.device) -> torch.Tensor:
        return torch.empty(shape["T"], shape["H"], device=device)

    def reference(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> torch.Tensor:
        ranks = [self.make_inputs(shape, world_size, r, seed, device) for r in range(world_size)]
        total = sum(inputs["x"].double() for inputs in ranks)
        return rmsnorm(total, ranks[0]["g"].double()).float()

    def cost(self, shape: Shape, world_size: int) -> Cost:
        t, h = shape["T"], shape["H"]
        return Cost(flops=0.0, comm_bytes=4.0 * 2 * (world_size - 1) / world_size * t * h,
                    memory_bytes=4.0 * (3 * t * h + h))

    def single_rank(self, inputs: Mapping[str, torch.Tensor | None], out: torch.Tensor | None = None,
                    **options: Any) -> torch.Tensor:
        """One rank holds the whole sum."""
        return rmsnorm(inputs["x"], inputs["g"])

    def shape_from_inputs(self, inputs: Mapping[str, torch.Tensor], world_size: int, rank: int,
                          out: torch.Tensor | None = None, **options: Any) -> Shape:
        input_names(inputs, ("x", "g"))
        x = checked_tensor("x", inputs["x"], 2, self.dtype)
        g = checked_tensor("g", inputs["g"], 1, self.dtype, x.device)
        if g.shape[0] != x.shape[1]:
            raise ValueError(f"g has {g.shape[0]} values, but x [T, H] has H={x.shape[1]}")
        return self.make_shape(*x.shape)
