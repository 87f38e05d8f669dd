"""Typed directives: the structured design space a search moves in.

A `DirectiveSet` names one strategy for a multi-GPU program: how bytes move (backend), where
communication sits relative to computation (placement), what a consumer waits for (sync scope),
who issues the transfers (issuer, comm CTAs), how big one transfer is (chunk bytes), whether the
payload is compressed (TACO FP8 with a group size) and the kernel language. Template knobs (a
workload's own tuning parameters, e.g. the seed's `order`) ride along in `knobs`.

`validate` gives every reason a set is not a meaningful strategy (never just "invalid"), so a
search or an LLM can learn from it. A `Space` holds a workload's ranges (chunk bytes, comm CTAs,
the compression its tolerance admits) and the machine's capabilities (GIN only with an RDMA NIC).
It imports only the contracts' format profile (group sizes, each FP8 format's expected error).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from typing import Any

from commweave.contracts.profile import COMPRESSION_ERROR, GROUP_SIZES

BACKENDS = ("lsa", "gin", "ce")
PLACEMENTS = ("deferred", "split", "fused")
SYNC_SCOPES = ("global", "peer", "chunk")
ISSUERS = ("thread", "warp", "cta")
COMPRESSIONS = ("none", "fp8_e4m3", "fp8_e5m2")
LANGUAGES = ("cuda", "triton")


DESCRIPTIONS = {
    "backend": {
        "lsa": "loads/stores into peers' symmetric windows over NVLink (NCCL LSA), issued by SM threads",
        "gin": "GPU-initiated networking: RDMA puts/signals issued from device code (needs an RDMA NIC)",
        "ce": "copy engines: peer copies queued on a side stream with device-visible flags, no SMs used",
    },
    "placement": {
        "deferred": "communicate everything, then compute (no overlap)",
        "split": "separate communication and compute kernels on their own streams, device-side flag waits",
        "fused": "communication inside the compute kernel, tile by tile",
    },
    "sync": {
        "global": "one barrier across all ranks before the data is used",
        "peer": "one signal per peer once its whole contribution has landed",
        "chunk": "one signal per chunk, so computation can start on the first chunk",
    },
    "issuer": {
        "thread": "single threads issue transfers",
        "warp": "each warp issues its own transfers",
        "cta": "whole CTAs cooperate on each transfer",
    },
    "compression": {
        "none": "payload sent as is",
        "fp8_e4m3": "FP8 e4m3 group quantisation before sending (TACO)",
        "fp8_e5m2": "FP8 e5m2 group quantisation before sending (TACO)",
    },
    "language": {"cuda": "CUDA C++ kernels (nvcc)", "triton": "Triton kernels"},
}


def _is_pow2(n: int) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class Capabilities:
    """What the machine offers the space; GIN needs an RDMA NIC and a GIN context from NCCL."""

    gin: bool = False
    gin_reason: str = "no RDMA NIC"

    @classmethod
    def from_probe(cls, probe: dict[str, Any]) -> Capabilities:
        """From `commweave.runtime.selftest:probe`'s answer (keys 'gin', 'gin_reason')."""
        return cls(bool(probe.get("gin")), str(probe.get("gin_reason") or ("" if probe.get("gin") else "unknown")))

    @classmethod
    def from_nics(cls, rdma_nics: list[str]) -> Capabilities:
        """A host-only guess (no communicator): without an RDMA NIC GIN cannot work."""
        if not rdma_nics:
            return cls(False, "no RDMA NIC")
        return cls(False, f"not probed (RDMA NICs: {', '.join(rdma_nics)}); run `commweave doctor`")


@dataclass(frozen=True)
class Space:
    """A workload's ranges and the machine's capabilities."""

    chunk_bytes_min: int = 64 << 10
    chunk_bytes_max: int = 64 << 20
    comm_ctas: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    #: the workload's tolerance (relative Frobenius error); compression is admitted only below it
    tolerance: float | None = None
    capabilities: Capabilities = field(default_factory=Capabilities)

    def chunk_sizes(self) -> tuple[int, ...]:
        sizes, n = [], self.chunk_bytes_min
        while n <= self.chunk_bytes_max:
            sizes.append(n)
            n *= 2
        return tuple(sizes)

    def admitted_compressions(self) -> tuple[str, ...]:
        tol = self.tolerance
        return ("none",) + tuple(c for c, err in COMPRESSION_ERROR.items() if tol is not None and err <= tol)

    def values(self, dim: str) -> tuple[Any, ...]:
        """Every value of a directive dimension (capabilities and tolerance are not applied here:
        `validate` explains why a value is excluded)."""
        return {"backend": BACKENDS, "placement": PLACEMENTS, "sync": SYNC_SCOPES, "issuer": ISSUERS,
                "comm_ctas": (0, *self.comm_ctas), "chunk_bytes": self.chunk_sizes(), "compression": COMPRESSIONS,
                "group_size": (0, *GROUP_SIZES), "language": LANGUAGES}[dim]


DIMENSIONS = ("backend", "placement", "sync", "issuer", "comm_ctas", "chunk_bytes", "compression", "group_size",
              "language")


@dataclass(frozen=True)
class DirectiveSet:
    """One strategy. `knobs` are the workload template's own parameters, as sorted (name, value)
    pairs so the set stays hashable; build it with `DirectiveSet.make(..., knobs={...})`."""

    backend: str = "lsa"
    placement: str = "split"
    sync: str = "chunk"
    issuer: str = "cta"
    comm_ctas: int = 8
    chunk_bytes: int = 1 << 20
    compression: str = "none"
    group_size: int = 0
    language: str = "cuda"
    knobs: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def make(cls, knobs: dict[str, Any] | None = None, **directives: Any) -> DirectiveSet:
        return cls(**directives, knobs=tuple(sorted((knobs or {}).items())))

    @property
    def knob_dict(self) -> dict[str, Any]:
        return dict(self.knobs)

    def get(self, dim: str) -> Any:
        """A directive or a knob (knobs are addressed as 'knob:<name>')."""
        if dim.startswith("knob:"):
            return self.knob_dict[dim[5:]]
        return getattr(self, dim)

    def with_(self, **changes: Any) -> DirectiveSet:
        """A copy with directives and/or knobs ('knob:<name>' keys or a `knobs` dict) changed."""
        knobs = self.knob_dict
        knobs.update(changes.pop("knobs", {}) or {})
        for key in [k for k in changes if k.startswith("knob:")]:
            knobs[key[5:]] = changes.pop(key)
        return replace(self, **changes, knobs=tuple(sorted(knobs.items())))

    def dimensions(self) -> list[str]:
        return [*DIMENSIONS, *(f"knob:{k}" for k, _ in self.knobs)]

    def diff(self, other: DirectiveSet) -> list[str]:
        """Dimensions (directives and knobs) whose values differ."""
        dims = dict.fromkeys([*self.dimensions(), *other.dimensions()])
        mine, theirs = self.knob_dict, other.knob_dict
        out = []
        for d in dims:
            a = mine.get(d[5:]) if d.startswith("knob:") else getattr(self, d)
            b = theirs.get(d[5:]) if d.startswith("knob:") else getattr(other, d)
            if a != b:
                out.append(d)
        return out

    # -- validity -------------------------------------------------------------------------------
    def validate(self, space: Space | None = None) -> list[str]:
        """Every reason this set is not a meaningful strategy here; [] when it is valid."""
        space = space or Space()
        why: list[str] = []
        for dim, allowed in (("backend", BACKENDS), ("placement", PLACEMENTS), ("sync", SYNC_SCOPES),
                             ("issuer", ISSUERS), ("compression", COMPRESSIONS), ("language", LANGUAGES)):
            if getattr(self, dim) not in allowed:
                why.append(f"{dim} must be one of {', '.join(allowed)}, not {getattr(self, dim)!r}")
        if why:
            return why
        if not _is_pow2(self.chunk_bytes):
            why.append(f"chunk_bytes {self.chunk_bytes} is not a power of two")
        elif not space.chunk_bytes_min <= self.chunk_bytes <= space.chunk_bytes_max:
            why.append(f"chunk_bytes {fmt_bytes(self.chunk_bytes)} is outside this workload's range "
                       f"{fmt_bytes(space.chunk_bytes_min)} .. {fmt_bytes(space.chunk_bytes_max)}")
        if self.backend == "ce":
            if self.comm_ctas != 0:
                why.append("backend ce moves data with copy engines, no SMs: comm_ctas must be 0")
            if self.placement == "fused":
                why.append("backend ce cannot be fused: copy engines are driven from streams, not from inside a compute kernel")
            if self.issuer != "thread":
                why.append("backend ce: one thread per flag writes the signals, so issuer must be thread")
        elif self.comm_ctas not in space.comm_ctas:
            why.append(f"comm_ctas must be one of {', '.join(map(str, space.comm_ctas))} for backend {self.backend}, "
                       f"not {self.comm_ctas}")
        if self.backend == "gin" and not space.capabilities.gin:
            why.append(f"backend gin is not available on this machine: {space.capabilities.gin_reason}")
        if self.placement == "deferred" and self.sync == "chunk":
            why.append("placement deferred computes only after all communication: per-chunk signals have nothing to "
                       "overlap (use sync global or peer)")
        if self.placement in ("split", "fused") and self.sync == "global":
            why.append(f"placement {self.placement} with a global barrier waits for all data before computing, which is "
                       "placement deferred: use sync peer or chunk to overlap")
        if self.language == "triton":
            if self.issuer != "cta":
                why.append("language triton programs whole blocks: issuer must be cta")
            if self.backend == "gin":
                why.append("language triton has no binding of NCCL's GIN device API")
        if self.compression == "none":
            if self.group_size != 0:
                why.append("group_size is only meaningful with compression: it must be 0 with compression none")
        else:
            if self.compression not in space.admitted_compressions():
                tol = "declares no tolerance for lossy communication" if space.tolerance is None else \
                    f"tolerance {space.tolerance:g} is below {self.compression}'s expected error {COMPRESSION_ERROR[self.compression]:.3f}"
                why.append(f"compression {self.compression} is not admitted: the workload {tol}")
            if self.group_size not in GROUP_SIZES:
                why.append(f"group_size must be one of {', '.join(map(str, GROUP_SIZES))} with compression, not {self.group_size}")
        return why

    def is_valid(self, space: Space | None = None) -> bool:
        return not self.validate(space)

    # -- serialisation --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "knobs"}
        out["knobs"] = self.knob_dict
        return out

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): equal sets give equal strings."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DirectiveSet:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown directive(s) {', '.join(unknown)} (known: {', '.join(sorted(names))})")
        data = dict(data)
        knobs = data.pop("knobs", {}) or {}
        return cls.make(knobs=dict(knobs), **data)

    @classmethod
    def from_json(cls, text: str) -> DirectiveSet:
        return cls.from_dict(json.loads(text))

    @property
    def key(self) -> str:
        return self.to_json()

    # -- prompt ---------------------------------------------------------------------------------
    def render_prompt(self) -> str:
        """A text section describing the strategy, for an LLM proposer's prompt."""
        lines = ["## Directives (the strategy this program must implement)"]
        for dim in ("backend", "placement", "sync", "issuer", "compression", "language"):
            value = getattr(self, dim)
            lines.append(f"- {dim}: `{value}` — {DESCRIPTIONS[dim][value]}")
        lines.insert(5, f"- comm_ctas: `{self.comm_ctas}` — CTAs (SMs) given to communication"
                        + (" (none: copy engines)" if self.backend == "ce" else ""))
        lines.insert(6, f"- chunk_bytes: `{self.chunk_bytes}` ({fmt_bytes(self.chunk_bytes)}) — bytes per transfer")
        if self.compression != "none":
            lines.append(f"- group_size: `{self.group_size}` — elements sharing one FP8 scale")
        if self.knobs:
            lines.append("- template knobs: " + ", ".join(f"`{k}={v!r}`" for k, v in self.knobs))
        return "\n".join(lines) + "\n"


def filter_capable(sets: list[DirectiveSet], space: Space) -> tuple[list[DirectiveSet], list[tuple[DirectiveSet, list[str]]]]:
    """Split sets into the valid ones and (set, reasons) for the rest (GIN without a NIC, ...)."""
    kept, excluded = [], []
    for ds in sets:
        reasons = ds.validate(space)
        if reasons:
            excluded.append((ds, reasons))
        else:
            kept.append(ds)
    return kept, excluded
