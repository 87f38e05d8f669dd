"""gemm-reducescatter's template: directive sets rendered onto the seed by editing its CONFIG knobs.

What the seed implements, and so what this template renders:
- backend `lsa` (owners pull peers' partials with NVLink loads through `ncclGetLsaPointer`), issuer
  `cta` (all threads of the reduction's CTAs sum a piece; one waits on each peer's flag), language
  `cuda`, no compression (a sum of lossy partials is not implemented);
- placement `split` (partial GEMMs on the current stream signal their owners, reductions on a side
  stream chase the flags) or `deferred` with sync `global` (CONFIG `overlap=False`: every GEMM,
  one LSA barrier, then one reduction: the conservative strategy);
- sync `chunk`: a flag per (source rank, piece); sync `peer` is the same code with one piece per
  block (a flag per source rank), so it renders `chunks=1`;
- comm CTAs -> CONFIG `comm_ctas`; chunk bytes -> CONFIG `chunks` = a block's partial bytes (M/W
  rows of N bf16) over the chunk bytes, at least 1, at most `MAX_CHUNKS`. The count depends on the
  shape, so a rendered program is specific to the shape it was rendered for (other shapes still run
  correctly, with other piece sizes);
- template knobs: `threads`, `order`, `comm_priority`, `wait`, `carveout`, `graph` (the seed's).
Everything else is rejected with the reason.
"""

from __future__ import annotations

from typing import Any

from commweave.contracts.program import with_config
from commweave.contracts.workload import Shape
from commweave.space import Capabilities, DirectiveSet, Space, Template

MAX_CHUNKS = 64  # more pieces per block than this only adds GEMM and reduction launches

KNOBS: dict[str, tuple[Any, ...]] = {
    # 1024 is left out: ptxas gives cw_rs_reduce 90 registers a thread, and 1024 x 90 exceeds the
    # 65536 registers of an SM, so such a launch fails with "too many resources requested".
    "threads": (128, 256, 512),
    "order": ("staggered", "aligned"),
    "comm_priority": (-1, 0),
    "wait": ("kernel", "stream"),
    "carveout": (True, False),
    "graph": (True, False),
}


class GemmReduceScatterTemplate(Template):
    one_gpu_dimensions = ()  # one GPU: the seed is the plain GEMM, whatever its directives

    def space(self, world_size: int, capabilities: Any = None) -> Space:
        return Space(chunk_bytes_min=256 << 10, chunk_bytes_max=64 << 20, comm_ctas=(1, 2, 4, 8, 16, 32),
                     tolerance=self.workload.tolerance(), capabilities=capabilities or Capabilities())

    def supported(self) -> dict[str, tuple[Any, ...]]:
        return {"backend": ("lsa",), "placement": ("split", "deferred"), "sync": ("chunk", "peer", "global"),
                "issuer": ("cta",), "compression": ("none",), "language": ("cuda",),
                **{f"knob:{k}": v for k, v in KNOBS.items()}}

    def seed_directives(self) -> DirectiveSet:
        """The seed as it is: 16 CTAs, four pieces per block at the default shape (8 MiB of a 32 MiB
        block at 8192^3 on 4 GPUs), its CONFIG defaults."""
        return DirectiveSet.make(backend="lsa", placement="split", sync="chunk", issuer="cta", comm_ctas=16,
                                 chunk_bytes=8 << 20, language="cuda",
                                 knobs=dict(threads=512, order="staggered", comm_priority=-1, wait="kernel",
                                            carveout=True, graph=True))

    def default_shape(self, world_size: int) -> Shape:
        return self.workload.make_shape(8192, 8192, 8192, world_size)

    @staticmethod
    def chunks_for(ds: DirectiveSet, shape: Shape, world_size: int) -> int:
        if ds.sync in ("peer", "global"):
            return 1
        block_bytes = shape["M"] // world_size * shape["N"] * 2  # bf16
        return max(1, min(MAX_CHUNKS, block_bytes // ds.chunk_bytes))

    def unsupported(self, ds: DirectiveSet) -> list[str]:
        why = super().unsupported(ds)
        if (ds.placement == "deferred") != (ds.sync == "global"):
            why.append(f"{self.workload.name}'s template pairs placement deferred with sync global (one barrier after "
                       f"every GEMM, then the reduction) and split with chunk or peer, not {ds.placement} with {ds.sync}")
        return why

    def render_text(self, ds: DirectiveSet, shape: Shape, world_size: int) -> str:
        return with_config(self.seed_text, comm_ctas=ds.comm_ctas, chunks=self.chunks_for(ds, shape, world_size),
                           overlap=ds.placement == "split", **ds.knob_dict)
