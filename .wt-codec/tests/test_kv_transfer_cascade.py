"""kv-transfer through the real cascade on CPU workers (gloo): the host baselines pass the
harness's own checks (poison, tolerance 0, untouched inputs) and benchmark side by side; a
program that puts pages in the wrong blocks is caught."""

from __future__ import annotations

import pytest

from commweave.evaluate import Evaluator, FailureClass
from commweave.runtime import WorkerPool
from commweave.workloads.kv_transfer.workload import KvTransfer

WL = KvTransfer()
SHAPES = [WL.parse_shape("S37-KV2", 2), WL.parse_shape("S300-L2", 2)]  # P = 0: no bf16 GEMMs on CPU


@pytest.fixture(scope="module")
def evaluator():
    with WorkerPool(2, device="cpu", job_timeout_s=120) as pool:
        yield Evaluator(pool, WL, seeds=2, warmup=1, iters=5)


@pytest.mark.parametrize("name", ["host", "host_per_block", "host_layerwise"])
def test_host_baselines_pass_the_cascade_check(evaluator: Evaluator, name: str) -> None:
    verdict = evaluator.check(WL.program_text(name), shapes=SHAPES)
    assert verdict.ok, verdict.message


def test_wrong_blocks_are_caught(evaluator: Evaluator) -> None:
    text = WL.program_text("host").replace('out.index_copy_(2, inputs["dst_blocks"],',
                                            'out.index_copy_(2, inputs["dst_blocks"].flip(0),')
    assert "flip(0)" in text
    verdict = evaluator.check(text, shapes=SHAPES[:1])
    assert not verdict.ok and verdict.failure == FailureClass.WRONG_RESULT, verdict.message


def test_seed_is_unavailable_on_cpu(evaluator: Evaluator) -> None:
    verdict = evaluator.check(WL.program_text("seed"), shapes=SHAPES[:1])
    assert verdict.failure == FailureClass.UNAVAILABLE and "CUDA" in verdict.message


def test_host_baselines_benchmark_side_by_side(evaluator: Evaluator) -> None:
    names = ("host", "host_per_block", "host_layerwise")
    result = evaluator.benchmark({n: WL.program_text(n) for n in names}, SHAPES[0])
    for name in names:
        timing = result.programs[name]
        assert timing.verdict.ok, f"{name}: {timing.verdict.message}"
        assert timing.median_us and len(timing.per_iter_us) == 5
