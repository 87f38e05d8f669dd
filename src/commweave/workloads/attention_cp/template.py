"""attention-cp's template: directive sets rendered onto its two device-initiated programs by
editing their CONFIG knobs.

What the programs implement, and so what this template renders:
- backend `lsa`, placement `split` (the K/V exchange on a side stream, attention per block on the
  current stream behind device-side waits), issuer `cta`, language `cuda`, no compression;
- knob `direction` picks the program: `push` is the seed (every rank stores its K/V shard into
  each peer's sequence buffer; the remote attention waits for every peer's signal), `pull` is
  `seed_pull` (each rank loads peers' K/V pieces into a ring of local slots, bounded memory);
- sync `peer`: one signal per peer shard (push; pull with one piece a shard segment); sync `chunk`
  (pull only): each shard segment cut into ceil(segment K/V bytes / chunk bytes) pieces, each
  waited for on its own, so attention starts on the first piece. Chunk bytes render nothing under
  sync peer (sets that differ only in them render the same program);
- comm CTAs -> CONFIG `comm_ctas` (the push kernel's or each pull kernel's CTAs);
- template knobs: `threads`, `comm_priority`, `graph`, `block_kernel` (CONFIG `backend`: the block
  attention kernel), `native_gqa` (both programs); `wait` (push); `slots`, `accumulate`, `q_block`
  (pull). A knob the chosen program lacks is not rendered.
Everything else is rejected with the reason.
"""

from __future__ import annotations

import math
from typing import Any

from commweave.contracts.program import with_config
from commweave.space import Capabilities, DirectiveSet, Space, Template
from commweave.contracts.workload import Shape, Workload

COMM_CTAS = (4, 8, 16, 32, 64)
KNOBS: dict[str, tuple[Any, ...]] = {
    "direction": ("push", "pull"),
    "threads": (256, 512),
    "comm_priority": (-1, 0),
    "graph": (True, False),
    "block_kernel": ("auto", "cudnn", "flash"),
    "native_gqa": (True, False),
    "wait": ("kernel", "stream"),  # push only
    "slots": (1, 2, 3),  # pull only
    "accumulate": ("out", "float32"),  # pull only
    "q_block": (0, 2048, 8192),  # pull only
}
PROGRAM = {"push": "seed", "pull": "seed_pull"}
ONLY = {"wait": "push", "slots": "pull", "accumulate": "pull", "q_block": "pull"}  # knobs of one program
RENAMED = {"block_kernel": "backend"}  # template knob -> CONFIG key (`backend` is also a directive)


class AttentionCPTemplate(Template):
    #: one GPU: the push or pull program's block attention (its kernel, GQA, query blocks, accumulator), graphed or not
    one_gpu_dimensions = ("knob:direction", "knob:block_kernel", "knob:native_gqa", "knob:q_block", "knob:accumulate",
                          "knob:graph")

    def __init__(self, workload: Workload):
        super().__init__(workload)
        self._texts = {direction: workload.program_text(name) for direction, name in PROGRAM.items()}

    def space(self, world_size: int, capabilities: Any = None) -> Space:
        return Space(chunk_bytes_min=1 << 20, chunk_bytes_max=1 << 30, comm_ctas=COMM_CTAS,
                     tolerance=self.workload.tolerance(), capabilities=capabilities or Capabilities())

    def supported(self) -> dict[str, tuple[Any, ...]]:
        return {"backend": ("lsa",), "placement": ("split",), "sync": ("peer", "chunk"), "issuer": ("cta",),
                "compression": ("none",), "group_size": (0,), "language": ("cuda",),
                **{f"knob:{k}": v for k, v in KNOBS.items()}}

    def unsupported(self, ds: DirectiveSet) -> list[str]:
        why = super().unsupported(ds)
        if ds.sync == "chunk" and ds.knob_dict.get("direction") == "push":
            why.append("attention-cp's push program signals once per peer shard (sync peer); per-chunk signals are "
                       "the pull program's (knob direction='pull')")
        return why

    def seed_directives(self) -> DirectiveSet:
        """The seed as it is: push, 16 CTAs, one signal per peer, its CONFIG defaults (and the pull
        program's for the knobs only it has)."""
        return DirectiveSet.make(backend="lsa", placement="split", sync="peer", issuer="cta", comm_ctas=16,
                                 chunk_bytes=64 << 20, language="cuda",
                                 knobs=dict(direction="push", threads=512, comm_priority=-1, graph=True,
                                            block_kernel="auto", native_gqa=True, wait="kernel", slots=2,
                                            accumulate="out", q_block=0))

    def default_shape(self, world_size: int) -> Shape:
        return self.workload.make_shape(32768, 32, 8, 128, False, world_size)

    @staticmethod
    def pieces(ds: DirectiveSet, shape: Shape, world_size: int) -> int:
        """Pieces per shard segment: 1 under sync peer, else the segment's K/V bytes over chunk bytes."""
        if ds.sync == "peer":
            return 1
        segments = 2 if shape["CAUSAL"] else 1  # zigzag: two chunks a rank
        segment_bytes = shape["S"] // (world_size * segments) * shape["HKV"] * shape["D"] * 2 * 2  # K and V, bf16
        return max(1, math.ceil(segment_bytes / ds.chunk_bytes))

    def config_for(self, ds: DirectiveSet, shape: Shape, world_size: int) -> dict[str, Any]:
        """The CONFIG entries `ds` sets in its program on `shape`."""
        knobs = ds.knob_dict
        direction = knobs["direction"]
        config = {RENAMED.get(k, k): v for k, v in knobs.items() if k != "direction" and ONLY.get(k, direction) == direction}
        config["comm_ctas"] = ds.comm_ctas
        if direction == "pull":
            config["chunks"] = self.pieces(ds, shape, world_size)
        return config

    def render_text(self, ds: DirectiveSet, shape: Shape, world_size: int) -> str:
        return with_config(self._texts[ds.knob_dict["direction"]], **self.config_for(ds, shape, world_size))

