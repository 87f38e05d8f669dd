"""What a compressed-collective backend is (`CollectiveBackend`), and which ranks a call runs over.

The public functions (`collectives`) resolve the `group=` a user gives once (`resolve_group`) and
hand every backend a ProcessGroup, or None for the default group: a backend never sees a mesh.
"""

from __future__ import annotations

from typing import Literal, Protocol, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from commweave.taco.wire import QuantConfig

AllReduceAlgo = Literal["one_shot", "two_shot"]
# None (the default group), a ProcessGroup, a one-dimensional DeviceMesh, or (mesh, dimension)
Group = Union[None, dist.ProcessGroup, DeviceMesh, tuple[DeviceMesh, Union[int, str]]]


class CollectiveBackend(Protocol):
    def all_gather(self, x: torch.Tensor, cfg: QuantConfig, group: dist.ProcessGroup | None) -> torch.Tensor: ...
    def reduce_scatter(self, x: torch.Tensor, cfg: QuantConfig, group: dist.ProcessGroup | None) -> torch.Tensor: ...
    def all_reduce(self, x: torch.Tensor, cfg: QuantConfig, algorithm: AllReduceAlgo,
                   group: dist.ProcessGroup | None) -> torch.Tensor: ...


def resolve_group(group: Group) -> dist.ProcessGroup | None:
    """The ProcessGroup `group` names; None for the default group (None or WORLD)."""
    if group is None or group is dist.group.WORLD:
        return None
    if isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"a {group.ndim}-dimensional DeviceMesh needs its dimension: pass group=(mesh, dim)")
        return resolve_group(group.get_group())
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        return resolve_group(group[0].get_group(group[1]))
    raise TypeError(f"group must be None, a ProcessGroup, a DeviceMesh or (DeviceMesh, dim), got {type(group).__name__}")
