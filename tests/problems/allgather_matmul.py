"""A problem in commweave's format: all-gather the rows of A, multiply by this rank's B. On a GPU
the product (1024 x 1024 x 1024 at W = 1) is most of a call's time, so doing it twice reads about
half the speed; its values are drawn there too, which keeps the judge's many draws cheap."""
import torch
import torch.distributed as dist

WORLD_SIZES = (1, 2, 4)
TOLERANCE = 1e-3


def make_inputs(rank, world_size, seed, device):
    rows, inner, cols = (128, 512, 256) if device.type == "cpu" else (1024, 1024, 1024)
    gen = torch.Generator(device).manual_seed(seed * 131 + rank)
    a = torch.randn(rows, inner, generator=gen, device=device)
    b = torch.randn(inner, cols, generator=gen, device=device)
    return (a, b)


def solution(a, b):
    parts = [torch.empty_like(a) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, a)
    return torch.cat(parts) @ b
