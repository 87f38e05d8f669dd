"""moe's template: directive sets rendered onto the seed by editing its CONFIG knobs.

What the seed implements, and so what this template renders:
- backend `lsa` (NVLink stores through `ncclGetLsaPointer`), placement `split` (the dispatch on a
  side stream, grouped GEMMs and combine on the current stream behind the flags), sync `peer` (one
  ready flag per (source, destination) pair), issuer `cta` (a CTA's warps copy rows, one release
  signal per CTA and destination), language `cuda`;
- compression `fp8_e4m3` / `fp8_e5m2` with a group size of 32..512 (CONFIG `compression`,
  `group_size`: token rows dispatched as FP8 with one scale per group, dequantized on arrival), only
  where the workload's tolerance admits the format (the space checks it: moe-lossy admits e4m3);
- comm CTAs -> CONFIG `comm_ctas` (the dispatch kernel's CTAs);
- chunk bytes: the seed signals once per (source, destination), so one value stands for "no
  chunking" (a per-chunk sync is not implemented and is rejected);
- template knobs: `threads`, `combine_ctas`, `combine_threads`, `comm_priority`, `experts`, `swiglu`,
  `wait`, `graph` (the seed's).
Everything else is rejected with the reason.
"""

from __future__ import annotations

from typing import Any

from commweave.contracts.program import with_config
from commweave.space import Capabilities, DirectiveSet, Space, Template
from commweave.contracts.workload import Shape

REGION = 64 << 20  # the chunk-bytes value that stands for "one flag per (source, destination)"

COMM_CTAS = (4, 8, 16, 32, 64)
KNOBS: dict[str, tuple[Any, ...]] = {
    # 1024 threads are left out: moe_dispatch has 64 registers a thread, 1024 x 64 leaves no room.
    "threads": (128, 256, 512),
    "combine_ctas": (16, 32, 64, 128),
    "combine_threads": (128, 256, 512),
    "comm_priority": (-1, 0),
    "experts": ("auto", "grouped", "streamed"),
    "swiglu": ("fused", "torch"),
    "wait": ("kernel", "stream"),
    "graph": (True, False),
}


class MoETemplate(Template):
    #: one GPU: the experts' GEMMs and SwiGLU, the combine's weighted sum, graphed or not
    one_gpu_dimensions = ("knob:experts", "knob:swiglu", "knob:combine_ctas", "knob:combine_threads", "knob:graph")

    def space(self, world_size: int, capabilities: Any = None) -> Space:
        return Space(chunk_bytes_min=REGION, chunk_bytes_max=REGION, comm_ctas=COMM_CTAS,
                     tolerance=self.workload.tolerance(), capabilities=capabilities or Capabilities())

    def supported(self) -> dict[str, tuple[Any, ...]]:
        return {"backend": ("lsa",), "placement": ("split",), "comm_ctas": COMM_CTAS, "sync": ("peer",), "issuer": ("cta",),
                "chunk_bytes": (REGION,), "compression": ("none", "fp8_e4m3", "fp8_e5m2"),
                "language": ("cuda",),
                **{f"knob:{k}": v for k, v in KNOBS.items()}}

    def seed_directives(self) -> DirectiveSet:
        """The seed as it is: 16 dispatch CTAs, one flag per (source, destination), its CONFIG defaults."""
        return DirectiveSet.make(backend="lsa", placement="split", sync="peer", issuer="cta", comm_ctas=16,
                                 chunk_bytes=REGION, language="cuda",
                                 knobs=dict(threads=512, combine_ctas=64, combine_threads=512, comm_priority=-1,
                                            experts="auto", swiglu="fused", wait="kernel", graph=True))

    def default_shape(self, world_size: int) -> Shape:
        """DeepSeek-V3 prefill (T 4096 a rank); on one GPU, its one-GPU bench shape (all 256 experts do not fit)."""
        return self.workload.bench_shapes(1)[0] if world_size == 1 else self.workload.dsv3_shape(4096, world_size)

    def render_text(self, ds: DirectiveSet, shape: Shape, world_size: int) -> str:
        compression = {"compression": ds.compression, "group_size": ds.group_size} if ds.compression != "none" else {}
        return with_config(self.seed_text, comm_ctas=ds.comm_ctas, **compression, **ds.knob_dict)

