"""Compress only where it was measured faster: per collective and message size, from the side-by-side
measurement (`taco.bandwidth.measure`, `bench/taco_bandwidth.py`), the compressed collective or
NCCL's plain one; for an all-reduce also one-shot or two-shot.

Why: compression pays only where the bytes saved outweigh compressing and decompressing; at small
messages (latency-bound) and for collectives whose compression costs more than it saves, the plain
collective is faster. A rule of thumb would be wrong on another machine or GPU count, so the choice
is read from measurements of this machine: a message of n bytes takes the verdict measured at the
largest size <= n (sizes below the smallest measured stay plain: unmeasured means not chosen).

Backend "auto" (`use_measurements(...)` registers it): `collectives.all_gather(x, cfg,
backend="auto")` and friends, so the TP layers take it like any backend; its all-reduce picks the
algorithm itself (the `algorithm` argument is ignored).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from commweave.taco import collectives as cc
from commweave.taco.bandwidth import OPS as MEASURED_OPS
from commweave.taco.backend import AllReduceAlgo
from commweave.taco.quant import QuantConfig

ALGORITHMS: dict[str, AllReduceAlgo] = {"all_reduce_one_shot": "one_shot", "all_reduce_two_shot": "two_shot"}


@dataclass(frozen=True)
class Selector:
    """Measured speedups (NCCL time / compressed time) per op, by message bytes, on `world` ranks."""

    world: int
    speedups: Mapping[str, tuple[tuple[int, float], ...]]  # op -> ((message bytes, speedup), ...), ascending
    margin: float = 1.0  # compress where the speedup exceeds this

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping[str, Any]], codec: str = "cuda", margin: float = 1.0) -> Selector:
        """From `bandwidth.measure` rows (op, mib, world, `<codec>_speedup`): one world size only."""
        rows = list(rows)
        worlds = {int(r["world"]) for r in rows}
        if len(worlds) != 1:
            raise ValueError(f"the measurements must be of one world size, got {sorted(worlds) or 'none'}")
        key = f"{codec}_speedup"
        table: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            if r["op"] not in MEASURED_OPS:
                raise ValueError(f"unknown op {r['op']!r} in the measurements; expected one of {MEASURED_OPS}")
            if key not in r:
                raise ValueError(f"the measurements have no {key!r} (codecs measured: "
                                 f"{sorted(k[:-8] for k in r if k.endswith('_speedup'))})")
            table.setdefault(r["op"], []).append((int(float(r["mib"]) * (1 << 20)), float(r[key])))
        return cls(worlds.pop(), {op: tuple(sorted(v)) for op, v in table.items()}, margin)

    @classmethod
    def from_file(cls, path: str | Path, codec: str = "cuda", margin: float = 1.0) -> Selector:
        """From a results JSON of bench/taco_bandwidth.py."""
        data = json.loads(Path(path).read_text())
        if "rows" not in data:
            raise ValueError(f"{path} holds no 'rows': not a bench/taco_bandwidth.py result")
        return cls.from_rows(data["rows"], codec, margin)

    def speedup(self, op: str, nbytes: int) -> float | None:
        """The speedup measured at the largest size <= nbytes; None below the smallest (or unmeasured op)."""
        if op not in MEASURED_OPS:
            raise ValueError(f"op must be one of {MEASURED_OPS}, got {op!r}")
        best = None
        for size, value in self.speedups.get(op, ()):
            if size <= nbytes:
                best = value
        return best

    def choose(self, op: str, nbytes: int, world: int) -> str | None:
        """For op 'all_gather' / 'reduce_scatter': op if compression was faster, else None (plain).
        For 'all_reduce': 'one_shot' or 'two_shot' (the faster one, if faster than plain), else None.
        nbytes: the whole message (all-gather's output, reduce-scatter's input, all-reduce's tensor)."""
        if world != self.world:
            raise ValueError(f"these measurements are of {self.world} ranks, the call runs on {world}: measure this "
                             f"world size (bench/taco_bandwidth.py --gpus {world})")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        candidates = {"all_gather": ("all_gather",), "reduce_scatter": ("reduce_scatter",),
                      "all_reduce": ("all_reduce_one_shot", "all_reduce_two_shot")}.get(op)
        if candidates is None:
            raise ValueError(f"op must be all_gather, reduce_scatter or all_reduce, got {op!r}")
        measured = [(s, c) for c in candidates if (s := self.speedup(c, nbytes)) is not None]
        if not measured:
            return None
        speedup, best = max(measured)
        if speedup <= self.margin:
            return None
        return ALGORITHMS.get(best, best)


class SelectingBackend:
    """Backend "auto": the `compressed` backend where the selector chose compression, the plain torch
    (NCCL) collective elsewhere."""

    def __init__(self, selector: Selector, compressed: str = "device"):
        self.selector = selector
        self.compressed = compressed

    @staticmethod
    def _world(group: Any) -> int:
        return dist.get_world_size(group)

    def all_gather(self, x: torch.Tensor, cfg: QuantConfig, group: Any = None) -> torch.Tensor:
        world = self._world(group)
        use = self.selector.choose("all_gather", x.numel() * x.element_size() * world, world)
        return cc.all_gather(x, cfg if use else None, group, self.compressed)

    def reduce_scatter(self, x: torch.Tensor, cfg: QuantConfig, group: Any = None) -> torch.Tensor:
        use = self.selector.choose("reduce_scatter", x.numel() * x.element_size(), self._world(group))
        return cc.reduce_scatter(x, cfg if use else None, group, self.compressed)

    def all_reduce(self, x: torch.Tensor, cfg: QuantConfig, algorithm: AllReduceAlgo, group: Any = None) -> torch.Tensor:
        """`algorithm` is the selector's, not the caller's."""
        algo = self.selector.choose("all_reduce", x.numel() * x.element_size(), self._world(group))
        return cc.all_reduce(x, cfg if algo else None, algo or "one_shot", group, self.compressed)


def use_measurements(source: str | Path | Selector, compressed: str = "device") -> SelectingBackend:
    """Register backend "auto" from a results JSON of bench/taco_bandwidth.py (or a Selector)."""
    selector = source if isinstance(source, Selector) else Selector.from_file(source)
    backend = SelectingBackend(selector, compressed)
    cc.register_backend("auto", backend)
    return backend
