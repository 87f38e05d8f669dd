"""A tiny CPU-friendly workload for the evaluator's tests: all-gather of float32 row shards, then a
product with a local matrix. Workers rebuild it as 'toy_workload:ToyGatherMatmul' (tests/ is on
the pool's PYTHONPATH); nothing is registered globally."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from commweave.contracts.workload import Cost, Shape, Workload

_DIMS = re.compile(r"^(\d+)x(\d+)x(\d+)$")


class ToyGatherMatmul(Workload):
    """Rank r holds a [M, K] (rows r*M.. of A) and b [K, N]; out [W*M, N] = all_gather(a) @ b."""

    name = "toy-gather-matmul"
    summary = "out = all_gather(a) @ b, float32, tiny"
    dtype = torch.float32
    world_sizes = (1, 2, 4)
    baselines = ("host",)

    @property
    def programs_dir(self) -> Path:
        return Path(__file__).parent / "programs_cpu"

    def make_shape(self, m: int, k: int, n: int) -> Shape:
        return Shape(f"{m}x{k}x{n}", {"M": m, "K": k, "N": n})

    def bench_shapes(self, world_size: int) -> list[Shape]:
        return [self.make_shape(64, 64, 64)]

    def check_shapes(self, world_size: int) -> list[Shape]:
        return [self.make_shape(3, 5, 7), self.make_shape(16, 8, 12)]

    def parse_shape(self, text: str, world_size: int) -> Shape:
        match = _DIMS.match(text.strip())
        if not match:
            raise ValueError(f"shape {text!r} is not 'MxKxN'")
        return self.make_shape(*(int(g) for g in match.groups()))

    def make_inputs(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
        # drawn on the device itself: the judge draws fresh inputs for every call of a timed batch
        gen = torch.Generator(device=device).manual_seed(seed * 1009 + rank)
        a = torch.randn(shape["M"], shape["K"], generator=gen, device=device)
        b = torch.randn(shape["K"], shape["N"], generator=gen, device=device)
        return {"a": a, "b": b}

    def make_output(self, shape: Shape, world_size: int, rank: int, device: torch.device) -> torch.Tensor:
        return torch.empty(world_size * shape["M"], shape["N"], device=device)

    def reference(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> torch.Tensor:
        a_full = torch.cat([self.make_inputs(shape, world_size, r, seed, device)["a"] for r in range(world_size)])
        return a_full.double().matmul(self.make_inputs(shape, world_size, rank, seed, device)["b"].double()).float()

    def cost(self, shape: Shape, world_size: int) -> Cost:
        m, k, n = shape["M"], shape["K"], shape["N"]
        return Cost(flops=2.0 * world_size * m * k * n, comm_bytes=4.0 * (world_size - 1) * m * k,
                    memory_bytes=4.0 * (world_size * m * k + k * n + world_size * m * n))


class ToyWithUnavailableBaseline(ToyGatherMatmul):
    """Its first baseline cannot run anywhere, so fitness must fall back to 'host'."""

    baselines = ("unavailable", "host")


class ToyWithTwoBaselines(ToyGatherMatmul):
    """Fitness is measured against 'host'; 'slow' is a second baseline a search need not time."""

    baselines = ("host", "slow")


class ToyWithoutBaseline(ToyGatherMatmul):
    """No baseline can run, so no fitness can be measured."""

    baselines = ("unavailable",)


class ToyZeroReference(ToyGatherMatmul):
    """A broken workload: its reference is all zeros, which no output may be judged against."""

    def reference(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(world_size * shape["M"], shape["N"], device=device)


class ToyOnlyInTheParent(ToyGatherMatmul):
    """A misconfigured workload: it cannot be built in a worker (where torch.distributed is up)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("this workload cannot be built in a worker")
