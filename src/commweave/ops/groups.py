"""The `group=` of an op: which ranks it spans, as the name torch's custom ops can carry.

A custom op cannot take a ProcessGroup object, so the ops take the group's name
(`group.group_name`) and resolve it where it is needed, as torch's functional collectives do.
The empty name means no process group at all: one process, W = 1, nothing to talk to.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

#: the name of "no group": a single process that never initialized torch.distributed
SINGLE = ""

#: what `group=` accepts: None (the default group, or a single process), a ProcessGroup, a 1-D
#: DeviceMesh, (DeviceMesh, dim) with dim an index or a dimension name, or a group's name
GroupLike = Any


def group_name(group: GroupLike = None) -> str:
    """The name of `group`; a ValueError names a value that is no group."""
    if group is None:
        return dist.group.WORLD.group_name if dist.is_available() and dist.is_initialized() else SINGLE
    if isinstance(group, str):
        if group != SINGLE:
            process_group(group)  # an unknown name fails here, with the name in the message
        return group
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    mesh, dim = group if isinstance(group, tuple) and len(group) == 2 else (group, None)
    get_group = getattr(mesh, "get_group", None)
    if get_group is None:
        raise ValueError(f"group must be None, a ProcessGroup, a DeviceMesh or (DeviceMesh, dim), not {type(group).__name__}")
    if dim is None and mesh.ndim != 1:
        raise ValueError(f"a {mesh.ndim}-D DeviceMesh spans several groups: pass group=(mesh, dim)")
    return get_group(dim).group_name if dim is not None else get_group().group_name


def process_group(name: str) -> dist.ProcessGroup:
    """The ProcessGroup named `name` (the empty name has none)."""
    if name == SINGLE:
        raise RuntimeError("torch.distributed is not initialized, so there is no process group (one process: the "
                           "ops compute locally and need none)")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"group {name!r} was named, but torch.distributed is not initialized")
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(name)
    except (KeyError, ValueError, RuntimeError) as exc:
        raise ValueError(f"no process group named {name!r} in this process ({exc})") from None


def group_size(name: str) -> int:
    """W: how many ranks the group spans (1 for a single process)."""
    return 1 if name == SINGLE else process_group(name).size()


def group_rank(name: str) -> int:
    """This process's rank within the group."""
    return 0 if name == SINGLE else dist.get_rank(process_group(name))
