"""gemm-allgather's template: directive sets rendered onto the seed by editing its CONFIG knobs.

What the seed implements, and so what this template renders:
- backend `lsa` (NVLink stores through `ncclGetLsaPointer`) with issuer `cta` (all threads of a CTA
  copy a chunk, one release signal per CTA), or backend `ce` (copy-engine copies into peers'
  windows and stream-written flags, comm CTAs 0, issuer `thread` as the space requires);
  placement `split` (communication on a side stream, GEMMs on the current stream chasing flags)
  or `deferred` with sync `global` (CONFIG `overlap=False`: the whole push, one LSA barrier, then
  the GEMMs: the conservative strategy), language `cuda`;
- compression `fp8_e4m3` / `fp8_e5m2` with a group size of 32..512 (CONFIG `compression`,
  `group_size`: TACO-compressed chunks pulled by the receivers; `comm_ctas` sizes the carve-out), with
  backend `lsa` and placement `split` only, and only where the workload's tolerance admits the
  format (the space checks it: gemm-allgather-lossy admits e4m3);
- sync `chunk`: one counter per (source shard, chunk); sync `peer` is the same code with one chunk
  per shard (a counter per source peer), so it renders `chunks=1`;
- comm CTAs -> CONFIG `comm_ctas`; chunk bytes -> CONFIG `chunks` = the shard's bytes (M/W rows of
  K bf16) over the chunk bytes, at least 1, at most `MAX_CHUNKS`. The chunk count depends on the
  shape, so a rendered program is specific to the shape it was rendered for (other shapes still run
  correctly, with other chunk sizes);
- template knobs: `threads`, `order`, `comm_priority`, `wait`, `carveout`, `graph` (the seed's).
Everything else is rejected with the reason.
"""

from __future__ import annotations

from typing import Any

from commweave.contracts.program import with_config
from commweave.space import Capabilities, DirectiveSet, Space, Template
from commweave.contracts.workload import Shape

MAX_CHUNKS = 64  # more pieces per shard than this only adds GEMM launches

KNOBS: dict[str, tuple[Any, ...]] = {
    # 1024 is left out: ptxas gives cw_ag_push 96 registers a thread, and 1024 x 96 exceeds the
    # 65536 registers of an SM, so such a launch fails with "too many resources requested".
    "threads": (128, 256, 512),
    "order": ("staggered", "broadcast"),
    "comm_priority": (-1, 0),
    "wait": ("kernel", "stream"),
    "carveout": (True, False),
    "graph": (True, False),
}


class GemmAllGatherTemplate(Template):
    #: one GPU: the GEMM of the whole A, with `comm_ctas` SMs carved out of it or not, in a CUDA graph or not
    one_gpu_dimensions = ("comm_ctas", "knob:carveout", "knob:graph")

    def space(self, world_size: int, capabilities: Any = None) -> Space:
        return Space(chunk_bytes_min=256 << 10, chunk_bytes_max=64 << 20, comm_ctas=(1, 2, 4, 8, 16, 32),
                     tolerance=self.workload.tolerance(), capabilities=capabilities or Capabilities())

    def supported(self) -> dict[str, tuple[Any, ...]]:
        return {"backend": ("lsa", "ce"), "placement": ("split", "deferred"), "sync": ("chunk", "peer", "global"),
                "issuer": ("cta", "thread"),
                "compression": ("none", "fp8_e4m3", "fp8_e5m2"),
                "language": ("cuda",),
                **{f"knob:{k}": v for k, v in KNOBS.items()}}

    def seed_directives(self) -> DirectiveSet:
        """The seed as it is: 8 CTAs, one chunk per shard (sync per peer), its CONFIG defaults."""
        return DirectiveSet.make(backend="lsa", placement="split", sync="peer", issuer="cta", comm_ctas=8,
                                 chunk_bytes=64 << 20, language="cuda",
                                 knobs=dict(threads=512, order="staggered", comm_priority=-1, wait="kernel",
                                            carveout=True, graph=True))

    def default_shape(self, world_size: int) -> Shape:
        return self.workload.make_shape(8192, 8192, 8192, world_size)

    @staticmethod
    def chunks_for(ds: DirectiveSet, shape: Shape, world_size: int) -> int:
        if ds.sync in ("peer", "global"):
            return 1
        shard_bytes = shape["M"] // world_size * shape["K"] * 2  # bf16
        return max(1, min(MAX_CHUNKS, shard_bytes // ds.chunk_bytes))

    def unsupported(self, ds: DirectiveSet) -> list[str]:
        why = super().unsupported(ds)
        if ds.backend == "lsa" and ds.issuer != "cta":
            why.append(f"{self.workload.name}'s lsa push is written per CTA (one signal per CTA): issuer cta only, not {ds.issuer!r}")
        if ds.compression != "none" and (ds.backend != "lsa" or ds.placement != "split"):
            why.append(f"{self.workload.name}'s compressed path pulls each chunk as its flag lands: backend lsa with "
                       f"placement split only, not {ds.backend} with {ds.placement}")
        if (ds.placement == "deferred") != (ds.sync == "global"):
            why.append(f"{self.workload.name}'s template pairs placement deferred with sync global (one barrier after "
                       f"the whole push, then the GEMMs) and split with chunk or peer, not {ds.placement} with {ds.sync}")
        return why

    def render_text(self, ds: DirectiveSet, shape: Shape, world_size: int) -> str:
        compression = {"compression": ds.compression, "group_size": ds.group_size} if ds.compression != "none" else {}
        return with_config(self.seed_text, backend=ds.backend, comm_ctas=ds.comm_ctas,
                           chunks=self.chunks_for(ds, shape, world_size), overlap=ds.placement == "split",
                           **compression, **ds.knob_dict)

