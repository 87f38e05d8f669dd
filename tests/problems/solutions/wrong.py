"""Wrong values: the local product only, no all-gather (right for one rank, wrong for more)."""
import torch
import torch.distributed as dist


def solution(a, b):
    return torch.cat([a] * dist.get_world_size()) @ b
