"""A problem's arguments and results as the judge moves them: flat named tensors plus a skeleton.

A problem's input maker returns a tuple of anything (tensors, nested lists and dicts of tensors,
scalars, split-size lists, process groups). The judge shares only tensors with a program process,
so `flatten_args` splits the tuple into its tensors (named `t0`, `t1`, ... in depth-first order)
and a *skeleton*: the structure with each tensor and process group replaced by a marker, pickled
into a fixed-size uint8 tensor `args` that travels like any other input. `rebuild_args` puts them
back together in the program process. Tensors left inside other objects (an nn.Linear's weights)
are pickled by their values, not as torch pickles them (by storage address): the judge compares
an `args` it filled with one it draws again from the same seed, byte for byte. A result (tensor,
tuple, dict, scalars) becomes one float32 vector (`flatten_result`), each leaf's elements in
order, then a constant 1.0 that keeps the relative error of a near-zero result absolute instead
of undefined.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

ARGS = "args"  # the input holding the pickled skeleton
HEADER = 8  # bytes of the skeleton's length before its pickle


def constant_key(rank: int) -> str:
    """The shape parameter that carries rank `rank`'s skeleton where it never changes with the seed."""
    return f"{ARGS}{rank}"


@dataclass(frozen=True)
class TensorLeaf:
    """Where tensor `name` goes back into the arguments (and whether it required grad)."""

    name: str
    requires_grad: bool


@dataclass(frozen=True)
class GroupLeaf:
    """A process group argument: None for the default group, else its index among the groups the
    input maker created (`recorded_groups`), which the program process creates again in order."""

    index: int | None


def flatten_args(args: tuple, group_index: Callable[[Any], int | None]) -> tuple[dict[str, torch.Tensor], Any]:
    """(tensors by name, skeleton) of an input maker's tuple; `group_index` names a process group."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            name = f"t{len(tensors)}"
            tensors[name] = value.detach().clone().contiguous()
            return TensorLeaf(name, bool(value.requires_grad))
        if isinstance(value, torch.distributed.ProcessGroup):
            return GroupLeaf(group_index(value))
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(walk(v) for v in value)
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        return value

    return tensors, walk(tuple(args))


def _tensor_from_bytes(data: bytes, dtype: str, shape: tuple[int, ...], device: str, parameter: bool,
                       requires_grad: bool) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    tensor = raw.view(getattr(torch, dtype)).reshape(shape).to(device)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)


class _ValuePickler(pickle.Pickler):
    """A pickler that writes a tensor as its dtype, shape, device and bytes: equal values, equal pickles."""

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        flat = obj.detach().cpu().contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        return _tensor_from_bytes, (data, str(obj.dtype).removeprefix("torch."), tuple(obj.shape), str(obj.device),
                                    isinstance(obj, torch.nn.Parameter), bool(obj.requires_grad))


def skeleton_bytes(skeleton: Any) -> bytes:
    """The skeleton pickled, the same bytes for the same values wherever its tensors live."""
    buffer = io.BytesIO()
    _ValuePickler(buffer).dump(skeleton)
    return buffer.getvalue()


def pack_pickled(data: bytes, capacity: int) -> torch.Tensor:
    """A skeleton's pickle (`skeleton_bytes`) in a uint8 tensor of `capacity` bytes (length first)."""
    if HEADER + len(data) > capacity:
        raise ValueError(f"the problem's non-tensor arguments take {len(data)} bytes pickled, more than the "
                         f"{capacity - HEADER} the first inputs left room for")
    out = torch.zeros(capacity, dtype=torch.uint8)
    out[:HEADER] = torch.tensor(list(len(data).to_bytes(HEADER, "little")), dtype=torch.uint8)
    out[HEADER:HEADER + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def unpack_skeleton(packed: torch.Tensor) -> Any:
    """The skeleton `pack_pickled` packed (on a GPU, a read back that waits for the stream)."""
    raw = bytes(packed.cpu().numpy().tobytes()) if packed.numel() else b""
    size = int.from_bytes(raw[:HEADER], "little")
    return skeleton_from_bytes(raw[HEADER:HEADER + size])


def skeleton_from_bytes(data: bytes) -> Any:
    """The skeleton `skeleton_bytes` pickled (the judge's own bytes: a program process trusts them)."""
    return pickle.loads(data)


def inline_tensors(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The skeleton with the leaves of `tensors` replaced by their values (pickled by value with
    it): a tensor whose shape changes with the seed travels this way, since the judge's shared
    buffers have one size per tensor."""

    def walk(value: Any) -> Any:
        if isinstance(value, TensorLeaf) and value.name in tensors:
            return tensors[value.name].detach().clone().requires_grad_(value.requires_grad)
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(walk(v) for v in value)
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        return value

    return walk(skeleton)


def rebuild_args(skeleton: Any, tensors: dict[str, torch.Tensor], group: Callable[[int | None], Any]) -> tuple:
    """The arguments again: each tensor leaf from `tensors`, each group leaf through `group`."""

    def walk(value: Any) -> Any:
        if isinstance(value, TensorLeaf):
            tensor = tensors[value.name]
            return tensor.detach().requires_grad_() if value.requires_grad else tensor  # a leaf of its own
        if isinstance(value, GroupLeaf):
            return group(value.index)
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(walk(v) for v in value)
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        return value

    return walk(skeleton)


def result_leaves(result: Any) -> list[torch.Tensor | float]:
    """A result's leaves in depth-first order (dicts by sorted key, None skipped): tensors as
    they are, numbers as floats. A ValueError names a leaf that is neither."""
    leaves: list[torch.Tensor | float] = []

    def walk(value: Any, where: str) -> None:
        if value is None:
            return
        if isinstance(value, torch.Tensor):
            leaves.append(value.detach())
        elif isinstance(value, (bool, int, float)):
            leaves.append(float(value))
        elif isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                walk(v, f"{where}[{i}]")
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(value[k], f"{where}[{k!r}]")
        else:
            raise ValueError(f"result{where} is a {type(value).__name__}; a solution returns tensors, numbers, "
                             "or tuples, lists and dicts of them")

    walk(result, "")
    return leaves


def flatten_result(result: Any) -> torch.Tensor:
    """A result as one float32 vector on its tensors' device: every leaf's elements in order, then
    the constant 1.0."""
    leaves = result_leaves(result)
    device = next((leaf.device for leaf in reversed(leaves) if isinstance(leaf, torch.Tensor)), torch.device("cpu"))
    out = torch.empty(sum(_length(leaf) for leaf in leaves) + 1, dtype=torch.float32, device=device)
    write_result(leaves, out)
    return out


def write_result(leaves: list[torch.Tensor | float], out: torch.Tensor) -> None:
    """`flatten_result`'s vector written straight into `out` (one copy per tensor leaf, converting
    as it copies: on a GPU no more kernels than the result needs); a ValueError when it does not fit."""
    total = sum(_length(leaf) for leaf in leaves) + 1
    if total > out.numel():
        raise ValueError(f"the result has {total - 1} elements, more than the reference's {out.numel() - 1} "
                         "(flattened)")
    offset = 0
    for leaf in leaves:
        n = _length(leaf)
        if isinstance(leaf, torch.Tensor):
            out[offset:offset + n].copy_(leaf.reshape(-1))
        else:
            out[offset:offset + 1].fill_(leaf)
        offset += n
    out[offset:offset + 1].fill_(1.0)


def _length(leaf: torch.Tensor | float) -> int:
    return leaf.numel() if isinstance(leaf, torch.Tensor) else 1
