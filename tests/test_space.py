"""The design space: validation with reasons, capabilities, serialisation, prompt, gemm template."""

from __future__ import annotations

import pytest

from commweave.contracts.program import load_program, parse_program
from commweave.space import Capabilities, DirectiveSet, Space, directives_of, filter_capable
from commweave.workloads import get_workload
from commweave.workloads.gemm_allgather.template import MAX_CHUNKS
from template_samples import renderable_samples

SPACE = Space(tolerance=0.1)


def test_default_set_is_valid():
    assert DirectiveSet().validate(SPACE) == []


INVALID = [
    (dict(backend="nvshmem"), "backend must be one of lsa, gin, ce"),
    (dict(chunk_bytes=3 << 20), "is not a power of two"),
    (dict(chunk_bytes=1 << 30), "outside this workload's range"),
    (dict(backend="ce", comm_ctas=8, issuer="thread"), "comm_ctas must be 0"),
    (dict(backend="ce", comm_ctas=0, issuer="thread", placement="fused"), "ce cannot be fused"),
    (dict(backend="ce", comm_ctas=0, issuer="cta"), "issuer must be thread"),
    (dict(comm_ctas=3), "comm_ctas must be one of"),
    (dict(backend="gin"), "gin is not available on this machine: no RDMA NIC"),
    (dict(placement="deferred", sync="chunk"), "nothing to overlap"),
    (dict(placement="split", sync="global"), "which is placement deferred"),
    (dict(language="triton", issuer="warp"), "issuer must be cta"),
    (dict(group_size=128), "group_size is only meaningful with compression"),
    (dict(compression="fp8_e4m3", group_size=100), "group_size must be one of"),
]


@pytest.mark.parametrize("changes,reason", INVALID, ids=[r for _, r in INVALID])
def test_invalid_sets_give_their_reason(changes, reason):
    why = DirectiveSet().with_(**changes).validate(SPACE)
    assert any(reason in w for w in why), why


def test_compression_needs_a_tolerance_that_allows_it():
    ds = DirectiveSet().with_(compression="fp8_e5m2", group_size=128)
    assert ds.validate(Space(tolerance=0.1)) == []
    assert "expected error" in " ".join(ds.validate(Space(tolerance=0.05)))
    assert DirectiveSet().with_(compression="fp8_e4m3", group_size=128).validate(Space(tolerance=0.05)) == []
    assert "declares no tolerance" in " ".join(ds.validate(Space(tolerance=None)))
    assert Space(tolerance=None).admitted_compressions() == ("none",)


def test_capability_filter_keeps_gin_only_where_probed():
    sets = [DirectiveSet(), DirectiveSet().with_(backend="gin")]
    kept, excluded = filter_capable(sets, Space(capabilities=Capabilities.from_nics([])))
    assert kept == [DirectiveSet()] and "no RDMA NIC" in excluded[0][1][0]
    probed = Capabilities.from_probe({"gin": True, "gin_reason": ""})
    kept, excluded = filter_capable(sets, Space(capabilities=probed))
    assert len(kept) == 2 and not excluded
    reason = Capabilities.from_probe({"gin": False, "gin_reason": "NCCL created no GIN context"}).gin_reason
    assert "GIN context" in DirectiveSet().with_(backend="gin").validate(
        Space(capabilities=Capabilities(False, reason)))[0]


def test_json_round_trip_and_canonical_key():
    ds = DirectiveSet.make(knobs={"b": 1, "a": "x"}, comm_ctas=4, chunk_bytes=1 << 18)
    again = DirectiveSet.from_json(ds.to_json())
    assert again == ds and again.key == ds.key and hash(again) == hash(ds)
    assert DirectiveSet.make(knobs={"a": "x", "b": 1}, comm_ctas=4, chunk_bytes=1 << 18).key == ds.key
    with pytest.raises(ValueError, match="unknown directive"):
        DirectiveSet.from_dict({"bogus": 1})
    assert ds.with_(**{"knob:a": "y"}).diff(ds) == ["knob:a"]


def test_prompt_describes_every_directive():
    text = DirectiveSet.make(knobs={"order": "staggered"}, compression="fp8_e4m3", group_size=128).render_prompt()
    for word in ("backend: `lsa`", "placement: `split`", "sync: `chunk`", "issuer: `cta`", "comm_ctas: `8`",
                 "1 MiB", "fp8_e4m3", "group_size: `128`", "language: `cuda`", "order='staggered'"):
        assert word in text


# -- gemm-allgather's template ------------------------------------------------------------------
TEMPLATE = get_workload("gemm-allgather").template()
SHAPE = TEMPLATE.default_shape(4)


def test_template_rejects_what_it_does_not_implement():
    seed = TEMPLATE.seed_directives()
    assert TEMPLATE.check(seed, 4) == []
    cases = {
        "fused": (dict(placement="fused"), "implements placement in split, deferred only"),
        "deferred with peer": (dict(placement="deferred"), "pairs placement deferred with sync global"),
        "split with global": (dict(sync="global"), "pairs placement deferred with sync global"),
        "triton": (dict(language="triton"), "implements language cuda only"),
        "warp": (dict(issuer="warp"), "implements issuer in cta, thread only"),
        "lsa by thread": (dict(issuer="thread"), "issuer cta only, not 'thread'"),
        "knob": (dict(knobs={"order": "ring"}), "knob order='ring' is not one of"),
    }
    for name, (changes, reason) in cases.items():
        assert any(reason in w for w in TEMPLATE.check(seed.with_(**changes), 4)), name
    with pytest.raises(ValueError, match="backend in lsa, ce only"):
        TEMPLATE.render(seed.with_(backend="gin"), SHAPE, 4)
    assert "no knob 'extra'" in " ".join(TEMPLATE.unsupported(seed.with_(knobs={"extra": 1})))


def test_template_renders_the_copy_engine_backend():
    """backend ce: comm CTAs 0 and issuer thread (the space's rules) render the seed's ce path."""
    from commweave.contracts.program import load_program

    ce = TEMPLATE.seed_directives().with_(backend="ce", comm_ctas=0, issuer="thread")
    assert TEMPLATE.check(ce, 4) == []
    config = load_program(TEMPLATE.render(ce, SHAPE, 4)).CONFIG
    assert (config["backend"], config["comm_ctas"]) == ("ce", 0)
    assert load_program(TEMPLATE.render(TEMPLATE.seed_directives(), SHAPE, 4)).CONFIG["backend"] == "lsa"


def test_compression_is_admitted_by_a_declared_tolerance_and_rendered():
    """gemm-allgather (bf16 tolerance) admits no compression; gemm-allgather-lossy declares 4 %
    and admits E4M3 (expected error 0.036) but not E5M2 (0.072); its template renders E4M3 with a
    group size into the seed's CONFIG, on backend lsa with placement split only."""
    from commweave.contracts.program import load_program
    from commweave.workloads import get_workload

    seed = TEMPLATE.seed_directives()
    e4m3 = seed.with_(compression="fp8_e4m3", group_size=128, sync="chunk", chunk_bytes=4 << 20)
    assert any("declares no tolerance" in w or "is not admitted" in w for w in TEMPLATE.check(e4m3, 4))
    lossy = get_workload("gemm-allgather-lossy").template()
    assert lossy.space(4).admitted_compressions() == ("none", "fp8_e4m3")
    assert lossy.check(e4m3, 4) == []
    config = load_program(lossy.render(e4m3, SHAPE, 4)).CONFIG
    assert (config["compression"], config["group_size"], config["backend"], config["overlap"]) == ("fp8_e4m3", 128, "lsa", True)
    assert load_program(lossy.render(seed, SHAPE, 4)).CONFIG["compression"] == "none"
    assert any("0.072" in w for w in lossy.check(e4m3.with_(compression="fp8_e5m2"), 4))
    for changes, reason in ((dict(backend="ce", comm_ctas=0, issuer="thread"), "backend lsa with placement split only"),
                            (dict(placement="deferred", sync="global"), "backend lsa with placement split only"),
                            (dict(group_size=1024), "group_size must be one of 32, 64, 128, 256, 512")):
        assert any(reason in w for w in lossy.check(e4m3.with_(**changes), 4)), (changes, lossy.check(e4m3.with_(**changes), 4))
    assert "gemm-allgather-lossy's" in " ".join(lossy.unsupported(e4m3.with_(language="triton")))


def test_template_renders_the_conservative_set():
    """placement deferred + sync global: the whole push, one LSA barrier, then the GEMMs
    (CONFIG overlap=False), one chunk per shard whatever the chunk bytes."""
    from commweave.contracts.program import load_program

    ds = TEMPLATE.seed_directives().with_(placement="deferred", sync="global", chunk_bytes=1 << 20)
    assert TEMPLATE.check(ds, 4) == []
    config = load_program(TEMPLATE.render(ds, SHAPE, 4)).CONFIG
    assert (config["overlap"], config["chunks"]) == (False, 1)
    assert load_program(TEMPLATE.render(TEMPLATE.seed_directives(), SHAPE, 4)).CONFIG["overlap"] is True


def test_chunk_bytes_become_chunks_per_shard():
    seed = TEMPLATE.seed_directives().with_(sync="chunk")
    shard = SHAPE["M"] // 4 * SHAPE["K"] * 2  # 32 MiB
    assert TEMPLATE.chunks_for(seed.with_(chunk_bytes=1 << 20), SHAPE, 4) == shard >> 20
    assert TEMPLATE.chunks_for(seed.with_(chunk_bytes=64 << 20), SHAPE, 4) == 1
    assert TEMPLATE.chunks_for(seed.with_(chunk_bytes=256 << 10), SHAPE, 4) == MAX_CHUNKS
    assert TEMPLATE.chunks_for(seed.with_(sync="peer", chunk_bytes=1 << 20), SHAPE, 4) == 1


def test_rendered_sample_parses_carries_its_directives_and_compiles():
    from commweave.runtime.compile import compile_cubin

    sources = set()
    # (compression stays none: gemm-allgather's tolerance admits none; the lossy variant's test renders it)
    for ds, text, config in renderable_samples(TEMPLATE, SHAPE, 4, seed=3, tries=12, fixed=("compression", "group_size")):
        assert config["comm_ctas"] == ds.comm_ctas and config["chunks"] == TEMPLATE.chunks_for(ds, SHAPE, 4)
        assert all(config[k] == v for k, v in ds.knobs)
        sources.update(parse_program(text).cuda_sources.values())
    assert sources
    for source in sources:
        assert compile_cubin(source).path.exists()


def test_seed_rendering_is_the_seed():
    rendered = TEMPLATE.render(TEMPLATE.seed_directives(), SHAPE, 4)
    assert load_program(rendered).CONFIG == load_program(TEMPLATE.workload.program_text("seed")).CONFIG


def test_templates_render_gin_only_where_the_probe_found_it():
    from commweave.space import Template

    class Anything(Template):
        def space(self, world_size, capabilities=None):
            return Space(capabilities=capabilities or Capabilities())

        def supported(self):
            return {}

        def seed_directives(self):
            return DirectiveSet()

        def render_text(self, ds, shape, world_size):
            return "# EVOLVE-BLOCK-START\ndef setup(ctx, shape): pass\ndef run(ctx, state, inputs, out): pass\n# EVOLVE-BLOCK-END\n"

    gin = DirectiveSet().with_(backend="gin")
    with pytest.raises(ValueError, match="no RDMA NIC"):
        Anything(get_workload("gemm-allgather")).render(gin, None, 2)
    text = Anything(get_workload("gemm-allgather")).render(gin, None, 2, Capabilities(True, ""))
    assert directives_of(text) == gin and parse_program(text)


def test_one_gpu_search_varies_only_what_one_gpu_shows():
    """At W = 1 (nothing to communicate) a template's search space keeps every dimension but its
    `one_gpu_dimensions` at the seed's value; those keep every value they have on 2 GPUs."""
    from commweave.search.proposer import OfflineProposer
    from commweave.contracts.workload import Cost
    from commweave.workloads import registry

    seen = 0
    for name, wl in registry().items():
        if 1 not in wl.world_sizes:
            continue
        try:
            template = wl.template()
        except LookupError:
            continue
        seen += 1
        one, two, seed = template.dimension_values(1), template.dimension_values(2), template.seed_directives()
        assert set(template.one_gpu_dimensions) <= set(one), (name, template.one_gpu_dimensions)
        for dim, values in one.items():
            if dim in template.one_gpu_dimensions:
                assert values == two[dim], (name, dim)
            else:
                assert values == (seed.get(dim),), (name, dim, values)
        varied = {d for d, v in one.items() if len(v) > 1}
        assert varied <= set(template.one_gpu_dimensions), (name, varied)
        assert set(OfflineProposer(template, 1, Cost()).dims) == varied, name
    assert seen >= 4  # gemm-allgather (and -lossy), attention-cp, moe (and -lossy), gemm-reducescatter
    plain_gemm = get_workload("gemm-reducescatter").template().dimension_values(1)  # its seed at W = 1
    assert all(len(values) == 1 for values in plain_gemm.values())
