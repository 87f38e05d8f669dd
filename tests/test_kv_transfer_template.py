"""kv-transfer's design-space template: what it renders, what it rejects, and that renders load."""

from __future__ import annotations

import pytest

from commweave.contracts.program import load_program
from commweave.space.template import program_body
from commweave.workloads import get_workload
from template_samples import renderable_samples

TEMPLATE = get_workload("kv-transfer").template()
SHAPE = TEMPLATE.default_shape(4)


def test_seed_rendering_is_the_seed():
    assert TEMPLATE.check(TEMPLATE.seed_directives(), 4) == []
    rendered = TEMPLATE.render(TEMPLATE.seed_directives(), SHAPE, 4)
    assert load_program(rendered).CONFIG == load_program(TEMPLATE.workload.program_text("seed")).CONFIG


def test_rejects_what_it_does_not_implement():
    seed = TEMPLATE.seed_directives()
    cases = {
        "fused": (dict(placement="fused"), "implements placement split only"),
        "peer": (dict(sync="peer"), "implements sync chunk only"),
        "warp": (dict(issuer="warp"), "implements issuer cta only"),
        "knob": (dict(knobs={"threads": 96, "unroll": 4, "comm_priority": -1, "graph": True}),
                 "knob threads=96 is not one of"),
        "unroll": (dict(knobs={"threads": 512, "unroll": 3, "comm_priority": -1, "graph": True}),
                   "knob unroll=3 is not one of"),
        "ctas": (dict(comm_ctas=200), "comm_ctas must be one of"),
    }
    for name, (changes, reason) in cases.items():
        assert any(reason in w for w in TEMPLATE.check(seed.with_(**changes), 4)), name
    with pytest.raises(ValueError, match="backend lsa only"):
        TEMPLATE.render(seed.with_(backend="gin"), SHAPE, 4)


def test_chunk_bytes_become_layers_per_launch():
    seed = TEMPLATE.seed_directives()
    layer = 2 * SHAPE["blocks"] * 16 * 8 * 128 * 2  # S8192: 32 MiB a layer
    assert layer == 32 << 20
    assert TEMPLATE.layers_per_launch(seed.with_(chunk_bytes=1 << 20), SHAPE) == 1
    assert TEMPLATE.layers_per_launch(seed.with_(chunk_bytes=128 << 20), SHAPE) == 4
    assert TEMPLATE.layers_per_launch(seed.with_(chunk_bytes=1 << 30), SHAPE) == 32


def test_comm_ctas_set_the_knob_of_the_shape():
    """With the stand-in prefill the communication CTAs are the destination's pulling ones
    (`pull_ctas`, pull mode) or the pushing ones taken from the GEMMs (`prefill_ctas`, push mode);
    transfer-only shapes set `ctas` and push every layer in one launch, so chunk bytes render
    nothing there."""
    seed = load_program(TEMPLATE.workload.program_text("seed")).CONFIG
    ds = TEMPLATE.seed_directives().with_(comm_ctas=96, chunk_bytes=128 << 20, knobs={"unroll": 8})
    prefill = load_program(TEMPLATE.render(ds, SHAPE, 2)).CONFIG
    got = (prefill["pull_ctas"], prefill["layers_per_launch"], prefill["ctas"], prefill["prefill_ctas"], prefill["unroll"])
    assert got == (96, 4, seed["ctas"], seed["prefill_ctas"], 8)
    pushing = load_program(TEMPLATE.render(ds.with_(knobs={"prefill_mode": "push"}), SHAPE, 2)).CONFIG
    assert (pushing["prefill_ctas"], pushing["pull_ctas"], pushing["prefill_mode"]) == (96, seed["pull_ctas"], "push")
    transfer_shape = TEMPLATE.workload.make_shape(8192, 2)
    transfer = load_program(TEMPLATE.render(ds, transfer_shape, 2)).CONFIG
    got = (transfer["ctas"], transfer["prefill_ctas"], transfer["layers_per_launch"])
    assert got == (96, seed["prefill_ctas"], seed["layers_per_launch"])
    other_chunk = TEMPLATE.render(ds.with_(chunk_bytes=1 << 20), transfer_shape, 2)
    assert program_body(other_chunk) == program_body(TEMPLATE.render(ds, transfer_shape, 2))


def test_rendered_sample_parses_and_carries_its_directives():
    rendered = 0
    for ds, _, config in renderable_samples(TEMPLATE, SHAPE, 4, seed=5, tries=40):
        comm = "pull_ctas" if ds.knob_dict["prefill_mode"] == "pull" else "prefill_ctas"
        assert config[comm] == ds.comm_ctas and config["layers_per_launch"] == TEMPLATE.layers_per_launch(ds, SHAPE)
        assert all(config[k] == v for k, v in ds.knobs)
        rendered += 1
    assert rendered
