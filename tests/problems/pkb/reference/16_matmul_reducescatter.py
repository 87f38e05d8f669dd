import torch
import torch.distributed as dist


def solution(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    partial = a @ b
    out = torch.empty(partial.shape[0] // dist.get_world_size(), partial.shape[1], dtype=partial.dtype,
                      device=partial.device)
    dist.reduce_scatter_tensor(out, partial)
    return out
