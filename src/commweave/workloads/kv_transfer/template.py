"""kv-transfer's template: directive sets rendered onto the seed by editing its CONFIG knobs.

What the seed implements, and so what this template renders:
- backend `lsa` (NVLink stores through `ncclGetLsaPointer` into the destination's symmetric cache),
  placement `split` (the push kernel on a side stream, the stand-in prefill on the current
  stream), issuer `cta` (a CTA copies whole pages, one release signal per CTA and layer), language
  `cuda`, no compression;
- sync `chunk`: one counter per layer on the destination;
- comm CTAs -> the CTA knob of the rendered shape: with the stand-in prefill (P > 0) CONFIG
  `pull_ctas` in pull mode (the destination's CTAs) or `prefill_ctas` in push mode (SMs taken from
  the GEMMs), else `ctas` (transfer only);
- chunk bytes -> CONFIG `layers_per_launch` = chunk bytes over one layer's bytes (2 * pages * page
  bytes), at least 1, at most L, for P > 0 shapes only: without a prefill the seed pushes every
  layer in one launch, so chunk bytes change nothing there and are not rendered (sets that differ
  only in them render the same program). Both mappings depend on the shape, so a rendered program
  is specific to the shape it was rendered for (others still run correctly);
- template knobs: `threads`, `unroll` (16-byte vectors in flight per thread), `comm_priority`,
  `graph`, `prefill_mode` (the seed's).
Everything else is rejected with the reason.
"""

from __future__ import annotations

from typing import Any

from commweave.contracts.program import with_config
from commweave.space import Capabilities, DirectiveSet, Space, Template
from commweave.contracts.profile import H200
from commweave.contracts.workload import Shape

KNOBS: dict[str, tuple[Any, ...]] = {
    # threads is the kernel's __launch_bounds__ (compiled in), so every value fits an SM
    "threads": (128, 256, 512, 1024),
    "unroll": (1, 2, 4, 8),
    "comm_priority": (-1, 0),
    "graph": (True, False),
    "prefill_mode": ("pull", "push"),  # P > 0: the destination pulls, or the source pushes (P = 0 always pushes)
}
COMM_CTAS = (1, 2, 4, 8, 16, 32, 64, 96, H200.sms)  # the last: one per SM


class KvTransferTemplate(Template):
    def space(self, world_size: int, capabilities: Any = None) -> Space:
        return Space(chunk_bytes_min=1 << 20, chunk_bytes_max=1 << 30, comm_ctas=COMM_CTAS,
                     tolerance=self.workload.tolerance(), capabilities=capabilities or Capabilities())

    def supported(self) -> dict[str, tuple[Any, ...]]:
        return {"backend": ("lsa",), "placement": ("split",), "sync": ("chunk",), "issuer": ("cta",),
                "compression": ("none",), "group_size": (0,), "language": ("cuda",),
                **{f"knob:{k}": v for k, v in KNOBS.items()}}

    def seed_directives(self) -> DirectiveSet:
        """The seed on the default (prefill) shape: pull mode with one pulling CTA per SM, one layer per
        launch, its CONFIG defaults."""
        return DirectiveSet.make(backend="lsa", placement="split", sync="chunk", issuer="cta", comm_ctas=H200.sms,
                                 chunk_bytes=1 << 20, language="cuda",
                                 knobs=dict(threads=512, unroll=4, comm_priority=-1, graph=True, prefill_mode="pull"))

    def default_shape(self, world_size: int) -> Shape:
        return self.workload.make_shape(8192, world_size, passes=13)

    @staticmethod
    def layers_per_launch(ds: DirectiveSet, shape: Shape) -> int:
        layer_bytes = 2 * shape["blocks"] * shape["B"] * shape["KV"] * shape["D"] * 2  # bf16
        return max(1, min(shape["L"], ds.chunk_bytes // layer_bytes))

    @staticmethod
    def config_for(ds: DirectiveSet, shape: Shape) -> dict[str, Any]:
        """The CONFIG entries `ds` sets on `shape`."""
        if shape["P"]:
            # the SMs given to communication: the destination's pulling CTAs, or the source's pushing ones
            which = "pull_ctas" if ds.knob_dict.get("prefill_mode", "pull") == "pull" else "prefill_ctas"
            return {which: ds.comm_ctas, "layers_per_launch": KvTransferTemplate.layers_per_launch(ds, shape),
                    **ds.knob_dict}
        return dict(ctas=ds.comm_ctas, **ds.knob_dict)

    def render_text(self, ds: DirectiveSet, shape: Shape, world_size: int) -> str:
        return with_config(self.seed_text, **self.config_for(ds, shape))

