"""Right values, twice the work: the reference's all-gather and product, done twice."""
import torch
import torch.distributed as dist


def _once(a, b):
    parts = [torch.empty_like(a) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, a)
    return torch.cat(parts) @ b


def solution(a, b):
    _once(a, b)
    return _once(a, b)
