"""TACO compressed collectives and TP layers across processes (CPU worker pool, gloo, 2 and 4 ranks),
against uncompressed torch collectives and a single-process reference; on 4 ranks also over two
TP pairs (`group=`: a ProcessGroup, a DeviceMesh dimension)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from commweave.runtime import WorkerPool
from commweave.taco.collectives import choose_all_reduce

TESTS = Path(__file__).parent
E4M3_BOUND, E5M2_BOUND = 0.035, 0.07  # one quantization step of Gaussian data (measured ~0.026, ~0.052)
BOUND = {"e4m3": E4M3_BOUND, "e5m2": E5M2_BOUND}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def pool(request):
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    with WorkerPool(request.param, device="cpu", job_timeout_s=60, env=env) as p:
        yield p


def _values(result):
    assert result.ok, result.first_failure().traceback if result.first_failure() else result.status
    return result.values


@pytest.mark.parametrize("fmt,group_size,hadamard", [("e4m3", 32, True), ("e4m3", 512, True), ("e5m2", 128, True),
                                                     ("e4m3", 128, "adaptive"), ("e5m2", 64, False)])
def test_compressed_collectives_match_torch_within_quantization_error(pool, fmt, group_size, hadamard):
    for r in _values(pool.run("taco_jobs:collectives_vs_torch", fmt=fmt, group_size=group_size, rows=8, cols=512,
                              hadamard=hadamard)):
        bound = BOUND[fmt]
        assert 0 < r["all_gather"] < bound and 0 < r["reduce_scatter"] < bound
        assert 0 < r["all_reduce_one_shot"] < bound
        assert 0 < r["all_reduce_two_shot"] < 1.5 * bound  # quantized twice
        assert r["all_gather_plain"] == 0.0
        assert r["reduce_scatter_plain"] < 1e-6 and r["all_reduce_plain"] < 1e-6
        assert r["identical_one"] and r["identical_two"] and r["x_untouched"]


def test_padding_odd_sizes_and_bf16(pool):
    for r in _values(pool.run("taco_jobs:odd_sizes")):
        assert r["all_gather"] < E4M3_BOUND and r["reduce_scatter"] < E4M3_BOUND
        assert r["two_shot"] < 1.5 * E4M3_BOUND
        assert r["bf16_dtype"] == "torch.bfloat16" and r["bf16"] < E4M3_BOUND


def test_auto_all_reduce_uses_the_selector(pool):
    n = pool.world_size
    expected = n * (n + 1) / 2
    for threshold in (0, 1 << 20):  # two-shot, then one-shot for the same 4 KiB message
        for row in _values(pool.run("taco_jobs:compressed_all_reduce_auto", one_shot_max_bytes=threshold)):
            assert all(abs(v - expected) < 0.07 * expected for v in row)


@pytest.mark.parametrize("compression", [None, "e4m3", "e5m2"])
def test_tp_mlp_forward_and_gradients_match_single_process(pool, compression):
    for r in _values(pool.run("taco_jobs:tp_mlp_vs_reference", compression=compression)):
        assert r["out_shape"] == [8 // pool.world_size, 2, 64]
        keys = ["out", "grad_x", "grad_w1", "grad_b1", "grad_w2", "grad_b2"]
        if compression is None:  # exact up to FP32 summation order
            assert all(r[k] < 1e-6 for k in keys), r
        else:
            # each path crosses one or two compressed collectives (grads: two)
            bound = 2 * BOUND[compression]
            assert all(r[k] < bound for k in keys), r
            assert r["out"] > 1e-4 and r["grad_x"] > 1e-4  # compression really was on


def test_selector_thresholds_are_explicit():
    assert choose_all_reduce(1 << 10, 4, one_shot_max_bytes=1 << 20) == "one_shot"
    assert choose_all_reduce(1 << 21, 4, one_shot_max_bytes=1 << 20) == "two_shot"
    assert choose_all_reduce(1 << 10, 16, one_shot_max_bytes=1 << 20, one_shot_max_world=8) == "two_shot"
    with pytest.raises(TypeError):
        choose_all_reduce(1 << 10, 4)  # type: ignore[call-arg]  (no unmeasured default)
    with pytest.raises(ValueError):
        choose_all_reduce(-1, 4, one_shot_max_bytes=0)


def test_unknown_backend_and_bad_shapes_are_refused():
    import torch

    from commweave.taco import collectives as cc
    from commweave.taco.quant import QuantConfig

    with pytest.raises(ValueError, match="unknown backend"):
        cc._backend("fused-gpu")
    with pytest.raises(ValueError, match="algorithm"):
        cc.ReferenceBackend().all_reduce(torch.zeros(4), QuantConfig(), "three_shot", None)  # type: ignore[arg-type]


def test_tp_compression_is_switchable_per_direction(pool):
    """Forward compressed, backward plain: the backward collectives add no error of their own, so the
    gradients' error comes from the compressed forward activations only."""
    both = _values(pool.run("taco_jobs:tp_mlp_vs_reference", compression="e4m3"))
    fwd_only = _values(pool.run("taco_jobs:tp_mlp_vs_reference", compression="e4m3", grad_compression=None))
    bwd_only = _values(pool.run("taco_jobs:tp_mlp_vs_reference", compression=None, grad_compression="e4m3"))
    for b, f, g in zip(both, fwd_only, bwd_only):
        assert f["out"] == b["out"] and 0 < f["out"] < 2 * E4M3_BOUND  # same forward (two compressed collectives)
        assert f["grad_x"] < b["grad_x"]  # its backward is exact
        assert g["out"] < 1e-6 and 1e-4 < g["grad_x"] < 2 * E4M3_BOUND  # exact forward, compressed backward


# (op, QuantConfig kwargs, shape (reduce_scatter: dim 0 per rank), dtype, seed), as tests/test_taco_device.py's
PAIR_CASES = [("all_gather", {}, (6, 96), "float32", 1),
              ("reduce_scatter", {"group_size": 32, "fmt": "e5m2"}, (3, 37), "float32", 2),
              ("one_shot", {"group_size": 64, "hadamard": "adaptive"}, (5, 100), "bfloat16", 3),
              ("two_shot", {}, (7, 33), "float32", 4),
              ("two_shot", {"group_size": 64, "hadamard": False, "dual_scale": False}, (4, 256), "float16", 5)]


def test_collectives_over_two_tp_pairs_equal_two_ranks_alone(pool):
    """group= a pair's ProcessGroup, (mesh, "tp") or mesh["tp"]: every op over each pair of 4 ranks
    gives, bit for bit, what 2 ranks alone give for that pair's inputs."""
    if pool.world_size != 4:
        pytest.skip("two TP pairs need 4 ranks")
    for found in _values(pool.run("taco_jobs:subgroups_vs_pair_simulation", cases=PAIR_CASES)):
        assert found == []


@pytest.mark.parametrize("compression", [None, "e4m3"])
def test_tp_mlp_over_two_pairs_matches_single_process(pool, compression):
    """The TP layers with group=(mesh, "tp"): each pair of 4 ranks trains its own MLP, matching that
    pair's single-process reference as a 2-rank TP group does."""
    if pool.world_size != 4:
        pytest.skip("two TP pairs need 4 ranks")
    results = _values(pool.run("taco_jobs:tp_mlp_vs_reference", compression=compression, pairs=True))
    keys = ["out", "grad_x", "grad_w1", "grad_b1", "grad_w2", "grad_b2"]
    for r in results:
        assert r["out_shape"] == [4, 2, 64]  # seq 8 over a TP group of 2
        assert all(r[k] < (1e-6 if compression is None else 2 * E4M3_BOUND) for k in keys), r
    assert results[0]["out"] != results[2]["out"] or compression is None  # each pair its own data


def test_a_bad_group_is_refused():
    from commweave.taco.backend import resolve_group

    with pytest.raises(TypeError, match="group must be None, a ProcessGroup, a DeviceMesh or"):
        resolve_group("tp")  # type: ignore[arg-type]
