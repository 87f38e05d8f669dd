import torch
import torch.distributed as dist


def solution(x: torch.Tensor, scale: float, group) -> torch.Tensor:
    y = x * scale
    dist.all_reduce(y, group=group)
    return y
