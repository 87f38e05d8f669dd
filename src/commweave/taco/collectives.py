"""Compressed collectives: the reference semantics, on host torch.distributed (gloo or NCCL).

Every function takes `cfg`: a QuantConfig compresses the message (FP8 payload + FP32 scales per
group, packed into one uint8 buffer per message, the layout a symmetric window would hold), None
runs the plain torch collective. Reductions decompress every contribution and sum in FP32 in rank
order, so all ranks get bit-identical results; a reduce-scatter takes its own chunk exactly (it
never crosses a link, and each rank's result is its own: nothing to keep identical across ranks).

  all_gather(x, cfg)            each rank's shard, concatenated along dim 0 (own shard included
                                after its round trip, so every rank holds the same tensor)
  reduce_scatter(x, cfg)        x split along dim 0 into world chunks, chunk r summed onto rank r
                                (rank r's own chunk exact, the others' after their round trip)
  all_reduce(x, cfg, "one_shot")  every rank reads all peers' compressed tensors, reduces in FP32
  all_reduce(x, cfg, "two_shot")  compressed reduce-scatter of the flattened groups, FP32 sum,
                                requantize, compressed all-gather (two quantization steps)
  choose_all_reduce(nbytes, world, one_shot_max_bytes=...)  size-based selector

The selector's threshold is a required parameter: it is to be measured on the GPU machine (one-
shot moves world-1 full messages per rank but needs one step; two-shot moves 2(world-1)/world of
one message per rank in two steps); no number is assumed here.

`backend` picks the implementation: "reference" (this module's host one), "device" (`taco.device`:
device-initiated over symmetric windows, bit for bit the reference; made at its first use), or one
given by `register_backend` (the selector's "auto"). `group` is a ProcessGroup, a DeviceMesh (one
dimension) or (mesh, dim) (`backend.resolve_group`); every backend runs over that group's ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from commweave.taco.backend import AllReduceAlgo, CollectiveBackend, Group, resolve_group
from commweave.taco.quant import Compressed, QuantConfig, compress, decompress, pack, unpack


def _world(group: ProcessGroup | None) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _check_dim0(x: torch.Tensor, world: int, what: str) -> None:
    if x.dim() == 0 or x.shape[0] % world:
        raise ValueError(f"{what}: dim 0 of shape {tuple(x.shape)} must be divisible by the world size {world}")


def _gather_packed(buf: torch.Tensor, world: int, group: ProcessGroup | None) -> list[torch.Tensor]:
    bufs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    return bufs


class ReferenceBackend:
    """Host implementation: compress, exchange packed uint8 buffers, decompress, reduce in FP32."""

    def all_gather(self, x: torch.Tensor, cfg: QuantConfig, group: ProcessGroup | None) -> torch.Tensor:
        world, _ = _world(group)
        bufs = _gather_packed(pack(compress(x, cfg)), world, group)
        return torch.cat([decompress(unpack(b, x.shape, x.dtype, cfg)) for b in bufs], dim=0)

    def reduce_scatter(self, x: torch.Tensor, cfg: QuantConfig, group: ProcessGroup | None) -> torch.Tensor:
        world, rank = _world(group)
        _check_dim0(x, world, "reduce_scatter")
        chunks = x.chunk(world, dim=0)
        send = torch.cat([pack(compress(c, cfg)) for c in chunks])  # chunk r goes to rank r
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        parts: list[Compressed | torch.Tensor] = [unpack(b, chunks[0].shape, x.dtype, cfg) for b in recv.chunk(world)]
        parts[rank] = chunks[rank]  # own chunk: exact (its compressed copy to itself is not used)
        return _sum_fp32(parts, x.dtype)

    def all_reduce(self, x: torch.Tensor, cfg: QuantConfig, algorithm: AllReduceAlgo, group: ProcessGroup | None) -> torch.Tensor:
        if algorithm not in ("one_shot", "two_shot"):
            raise ValueError(f"algorithm must be 'one_shot' or 'two_shot', got {algorithm!r}")
        world, _ = _world(group)
        if algorithm == "one_shot":
            bufs = _gather_packed(pack(compress(x, cfg)), world, group)
            return _sum_fp32([unpack(b, x.shape, x.dtype, cfg) for b in bufs], x.dtype)
        # Shard by whole groups: the flattened tensor is padded to world * G-multiples.
        flat = x.reshape(-1)
        per_rank = -(-flat.numel() // (world * cfg.group_size)) * cfg.group_size
        padded = torch.nn.functional.pad(flat, (0, per_rank * world - flat.numel()))
        mine = self.reduce_scatter(padded.view(world, per_rank), cfg, group)  # (1, per_rank), FP32-summed
        full = self.all_gather(mine, cfg, group)  # requantized, (world, per_rank)
        return full.reshape(-1)[: flat.numel()].view(x.shape)


def _sum_fp32(parts: list[Compressed | torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """FP32 sum in order (the first term not added to zero: -0.0 stays), cast to dtype; a tensor
    part is a rank's own contribution, taken exactly."""
    def term(p: Compressed | torch.Tensor) -> torch.Tensor:
        return p.float() if isinstance(p, torch.Tensor) else decompress(p, torch.float32)

    total = term(parts[0])
    for p in parts[1:]:
        total = total + term(p)
    return total.to(dtype)


def _device_backend() -> CollectiveBackend:
    from commweave.taco.device import DeviceBackend  # CUDA only: not imported until asked for

    return DeviceBackend()


# backends made at their first use; register_backend adds or replaces one
_FACTORIES: dict[str, Callable[[], CollectiveBackend]] = {"reference": ReferenceBackend, "device": _device_backend}
_BACKENDS: dict[str, CollectiveBackend] = {}


def register_backend(name: str, backend: CollectiveBackend) -> None:
    """Make `backend` selectable as `backend=name` in the functions below."""
    _BACKENDS[name] = backend


def _backend(name: str) -> CollectiveBackend:
    if name not in _BACKENDS and name in _FACTORIES:
        _BACKENDS[name] = _FACTORIES[name]()
    try:
        return _BACKENDS[name]
    except KeyError:
        if name == "auto":
            raise ValueError("backend 'auto' chooses from measurements: register them first with "
                             "commweave.taco.selector.use_measurements(<bench/taco_bandwidth.py results JSON>)") from None
        raise ValueError(f"unknown backend {name!r}; known: {sorted({*_FACTORIES, *_BACKENDS})}") from None


# -- public API -------------------------------------------------------------------------------

def all_gather(x: torch.Tensor, cfg: QuantConfig | None = None, group: Group = None, backend: str = "reference") -> torch.Tensor:
    """Shards of every rank concatenated along dim 0 (compressed when cfg is given)."""
    x, group = x.contiguous(), resolve_group(group)
    if cfg is None:
        world, _ = _world(group)
        out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    return _backend(backend).all_gather(x, cfg, group)


def reduce_scatter(x: torch.Tensor, cfg: QuantConfig | None = None, group: Group = None,
                   backend: str = "reference") -> torch.Tensor:
    """Sum over ranks of chunk `rank` of x split along dim 0 (compressed when cfg is given)."""
    x, group = x.contiguous(), resolve_group(group)
    world, _ = _world(group)
    _check_dim0(x, world, "reduce_scatter")
    if cfg is None:
        out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x, group=group)
        return out
    return _backend(backend).reduce_scatter(x, cfg, group)


def all_reduce(x: torch.Tensor, cfg: QuantConfig | None = None, algorithm: AllReduceAlgo = "one_shot",
               group: Group = None, backend: str = "reference") -> torch.Tensor:
    """Sum over ranks, returned as a new tensor (x is not modified)."""
    group = resolve_group(group)
    if cfg is None:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out
    return _backend(backend).all_reduce(x.contiguous(), cfg, algorithm, group)


def choose_all_reduce(nbytes: int, world_size: int, *, one_shot_max_bytes: int,
                      one_shot_max_world: int = 8) -> AllReduceAlgo:
    """One-shot up to `one_shot_max_bytes` (latency-bound sizes) on at most `one_shot_max_world`
    ranks, two-shot above (bandwidth-bound). Thresholds are parameters, to be measured on GPUs."""
    if nbytes < 0 or world_size < 1:
        raise ValueError(f"nbytes must be >= 0 and world_size >= 1, got {nbytes}, {world_size}")
    if world_size <= one_shot_max_world and nbytes <= one_shot_max_bytes:
        return "one_shot"
    return "two_shot"


def compressed_all_reduce(x: torch.Tensor, cfg: QuantConfig, *, one_shot_max_bytes: int, group: Group = None,
                          backend: str = "reference") -> torch.Tensor:
    """all_reduce with the algorithm picked by choose_all_reduce from x's size in bytes."""
    world, _ = _world(resolve_group(group))
    algo = choose_all_reduce(x.numel() * x.element_size(), world, one_shot_max_bytes=one_shot_max_bytes)
    return all_reduce(x, cfg, algo, group, backend)
