"""The measured choice between compressed and plain collectives (commweave.taco.selector)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from commweave.runtime import WorkerPool
from commweave.taco import collectives as cc
from commweave.taco.selector import Selector

TESTS = Path(__file__).parent
RESULTS = TESTS.parent / "bench" / "results"
MIB = 1 << 20


def _rows(world: int = 2) -> list[dict]:
    return [
        {"op": "all_gather", "mib": 1, "world": world, "cuda_speedup": 0.6},
        {"op": "all_gather", "mib": 16, "world": world, "cuda_speedup": 1.2},
        {"op": "all_gather", "mib": 256, "world": world, "cuda_speedup": 1.3},
        {"op": "reduce_scatter", "mib": 16, "world": world, "cuda_speedup": 0.9},
        {"op": "all_reduce_one_shot", "mib": 4, "world": world, "cuda_speedup": 1.1},
        {"op": "all_reduce_two_shot", "mib": 4, "world": world, "cuda_speedup": 0.7},
        {"op": "all_reduce_one_shot", "mib": 64, "world": world, "cuda_speedup": 1.05},
        {"op": "all_reduce_two_shot", "mib": 64, "world": world, "cuda_speedup": 1.4},
    ]


def test_the_verdict_of_the_largest_measured_size_at_or_below_the_message():
    s = Selector.from_rows(_rows())
    assert s.choose("all_gather", MIB // 2, 2) is None  # below every measurement: plain
    assert s.choose("all_gather", 8 * MIB, 2) is None  # the 1 MiB verdict
    assert s.choose("all_gather", 16 * MIB, 2) == "all_gather"
    assert s.choose("all_gather", 1 << 40, 2) == "all_gather"  # above the largest: its verdict
    assert s.choose("reduce_scatter", 256 * MIB, 2) is None  # never faster
    assert s.choose("all_reduce", 2 * MIB, 2) is None
    assert s.choose("all_reduce", 4 * MIB, 2) == "one_shot"
    assert s.choose("all_reduce", 64 * MIB, 2) == "two_shot"  # the faster of the two
    assert Selector.from_rows(_rows(), margin=1.25).choose("all_gather", 16 * MIB, 2) is None
    assert s.speedup("all_reduce_two_shot", 100 * MIB) == 1.4


def test_bad_measurements_and_calls_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="one world size"):
        Selector.from_rows(_rows(2) + _rows(4))
    with pytest.raises(ValueError, match="unknown op 'broadcast'"):
        Selector.from_rows([{"op": "broadcast", "mib": 1, "world": 2, "cuda_speedup": 2.0}])
    with pytest.raises(ValueError, match=r"no 'triton_speedup' \(codecs measured: \['cuda'\]\)"):
        Selector.from_rows(_rows(), codec="triton")
    s = Selector.from_rows(_rows())
    with pytest.raises(ValueError, match="measurements are of 2 ranks, the call runs on 4"):
        s.choose("all_gather", MIB, 4)
    with pytest.raises(ValueError, match="op must be all_gather, reduce_scatter or all_reduce"):
        s.choose("all_to_all", MIB, 2)
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        s.choose("all_gather", -1, 2)


def test_reads_a_bench_results_file(tmp_path):
    """The newest committed 2-GPU sweep (>= 5 sizes; shorter runs compare variants at a few sizes)."""
    sweeps = [p for p in sorted(RESULTS.glob("taco-bandwidth-2gpu-*.json"))
              if len({r["mib"] for r in json.loads(p.read_text())["rows"]}) >= 5]
    assert sweeps, "no committed bench/taco_bandwidth.py sweep of 5 sizes or more"
    s = Selector.from_file(sweeps[-1])
    assert s.world == 2 and set(s.speedups) == {"all_gather", "reduce_scatter", "all_reduce_one_shot",
                                                "all_reduce_two_shot"}
    for op, points in s.speedups.items():
        assert [size for size, _ in points] == sorted(size for size, _ in points) and len(points) >= 5, op
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="holds no 'rows'"):
        Selector.from_file(bad)


def test_auto_needs_measurements_first():
    if "auto" in cc._BACKENDS:
        pytest.skip("another test registered 'auto' in this process")
    with pytest.raises(ValueError, match="use_measurements"):
        cc._backend("auto")


def test_auto_backend_compresses_only_where_chosen_over_gloo():
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    with WorkerPool(2, device="cpu", job_timeout_s=60, env=env) as pool:
        result = pool.run("taco_jobs:selecting_backend_vs_direct")
    assert result.ok, result.first_failure().traceback if result.first_failure() else result.status
    for r in result.values:
        assert all(r.values()), r
