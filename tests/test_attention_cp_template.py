"""attention-cp's design-space template: what it renders onto the push seed and the pull program,
what it rejects, and that renders load and are searchable."""

from __future__ import annotations

import random

import pytest

from commweave.contracts.program import load_program
from commweave.search.proposer import Memory, OfflineProposer
from commweave.space.template import program_body
from commweave.workloads import get_workload
from template_samples import renderable_samples

TEMPLATE = get_workload("attention-cp").template()
SHAPE = TEMPLATE.default_shape(4)  # 32k tokens, 32/8 heads, D 128, full: 8192 rows a rank


def test_seed_rendering_is_the_seed():
    assert TEMPLATE.check(TEMPLATE.seed_directives(), 4) == []
    rendered = TEMPLATE.render(TEMPLATE.seed_directives(), SHAPE, 4)
    assert load_program(rendered).CONFIG == load_program(TEMPLATE.workload.program_text("seed")).CONFIG
    assert TEMPLATE.workload.template().workload.name == "attention-cp"


def test_rejects_what_it_does_not_implement():
    seed = TEMPLATE.seed_directives()
    cases = {
        "fused": (dict(placement="fused"), "implements placement split only"),
        "global": (dict(sync="global"), "sync in peer, chunk only"),
        "ce": (dict(backend="ce", comm_ctas=0, issuer="thread"), "backend lsa only"),
        "push per chunk": (dict(sync="chunk"), "per-chunk signals are the pull program's"),
        "knob": (dict(knobs={"slots": 4}), "knob slots=4 is not one of"),
        "ctas": (dict(comm_ctas=12), "comm_ctas must be one of"),
        "fp8": (dict(compression="fp8_e4m3", group_size=128), "compression fp8_e4m3 is not admitted"),
    }
    for name, (changes, reason) in cases.items():
        assert any(reason in w for w in TEMPLATE.check(seed.with_(**changes), 4)), (name, TEMPLATE.check(seed.with_(**changes), 4))
    with pytest.raises(ValueError, match="per-chunk signals are the pull program's"):
        TEMPLATE.render(seed.with_(sync="chunk"), SHAPE, 4)


def test_direction_picks_the_program_and_chunk_bytes_become_pieces():
    """pull renders seed_pull: sync peer is one piece a shard segment, sync chunk cuts a segment's
    K/V bytes (32k full on 4 GPUs: 8192 rows x 8 heads x 128 x 2 bytes x K and V = 32 MiB) into
    chunk-byte pieces; causal shards have two segments of half the rows."""
    pull = TEMPLATE.seed_directives().with_(knobs={"direction": "pull", "slots": 3, "block_kernel": "flash"})
    config = load_program(TEMPLATE.render(pull, SHAPE, 4)).CONFIG
    assert (config["chunks"], config["slots"], config["backend"]) == (1, 3, "flash")
    assert "chunks" in load_program(TEMPLATE.workload.program_text("seed_pull")).CONFIG
    chunked = pull.with_(sync="chunk", chunk_bytes=8 << 20)
    assert load_program(TEMPLATE.render(chunked, SHAPE, 4)).CONFIG["chunks"] == 4
    causal = TEMPLATE.workload.make_shape(32768, 32, 8, 128, True, 4)
    assert TEMPLATE.pieces(chunked, causal, 4) == 2
    assert TEMPLATE.pieces(chunked.with_(chunk_bytes=1 << 30), SHAPE, 4) == 1
    # the push seed has neither chunks nor slots: knobs it lacks render nothing
    push = TEMPLATE.seed_directives()
    assert "slots" not in load_program(TEMPLATE.render(push, SHAPE, 4)).CONFIG
    assert program_body(TEMPLATE.render(push.with_(knobs={"slots": 1, "q_block": 2048}), SHAPE, 4)) == \
        program_body(TEMPLATE.render(push, SHAPE, 4))
    assert program_body(TEMPLATE.render(pull.with_(chunk_bytes=1 << 20), SHAPE, 4)) == \
        program_body(TEMPLATE.render(pull, SHAPE, 4))  # sync peer: chunk bytes render nothing


def test_rendered_sample_parses_and_carries_its_directives():
    rendered = {"push": 0, "pull": 0}
    for ds, _, config in renderable_samples(TEMPLATE, SHAPE, 4, seed=3, tries=80):
        assert config["comm_ctas"] == ds.comm_ctas and config["backend"] == ds.knob_dict["block_kernel"]
        if ds.knob_dict["direction"] == "pull":
            assert config["chunks"] == TEMPLATE.pieces(ds, SHAPE, 4) and config["slots"] == ds.knob_dict["slots"]
        else:
            assert config["wait"] == ds.knob_dict["wait"]
        rendered[ds.knob_dict["direction"]] += 1
    assert rendered["push"] and rendered["pull"]


def test_the_offline_proposer_searches_it():
    proposer = OfflineProposer(TEMPLATE, 4, TEMPLATE.workload.cost(SHAPE, 4))
    memory, rng = Memory(), random.Random(0)
    for phase in ("exploit", "explore") * 5:
        p = proposer.propose(TEMPLATE.seed_directives(), phase, memory, rng)
        assert TEMPLATE.check(p.directives, 4) == []
        memory.record(p.directives, TEMPLATE.seed_directives(), 0.0, None)
