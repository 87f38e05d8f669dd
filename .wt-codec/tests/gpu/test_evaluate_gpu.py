"""The cascade on real GPUs (gemm-allgather): broken CUDA candidates are classified, the pool
survives each one, and the baselines and the seed are judged and timed side by side.

Run on the GPU machine with `pytest -m gpu tests/gpu/test_evaluate_gpu.py`."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import commweave.evaluate.evaluator as evaluator_module
from commweave.evaluate import EvalResult, Evaluator, FailureClass, MachineRates, calibrate
from commweave.runtime import WorkerPool
from commweave.workloads import get_workload

WORLD = min(torch.cuda.device_count(), 4)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WORLD < 2, reason="needs at least 2 CUDA GPUs")]
PROGRAMS = Path(__file__).parent.parent / "programs_gpu"


def program(name: str) -> str:
    return (PROGRAMS / f"{name}.py").read_text()


@pytest.fixture(scope="module")
def workload():
    return get_workload("gemm-allgather")


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(WORLD, device="cuda", job_timeout_s=300) as p:
        yield p


@pytest.fixture(scope="module")
def evaluator(pool, workload):
    """Short job timeout: the deadlock test waits this long."""
    return Evaluator(pool, workload, job_timeout_s=30)


def assert_host_passes(evaluator: Evaluator) -> None:
    verdict = evaluator.check(evaluator.workload.program_text("host"))
    assert verdict.ok, verdict.message


def test_workload_programs_pass_their_checks(evaluator):
    for name in ("host", "seed"):
        verdict = evaluator.check(evaluator.workload.program_text(name))
        assert verdict.ok, f"{name}: {verdict.message}"
    async_tp = evaluator.check(evaluator.workload.program_text("torch_async_tp"))
    assert async_tp.ok or async_tp.failure == FailureClass.UNAVAILABLE, async_tp.message


BROKEN = [
    ("deadlock", FailureClass.TIMEOUT, "no answer within"),
    ("illegal_address", FailureClass.ILLEGAL_ADDRESS, "illegal"),
    ("wrong_values", FailureClass.WRONG_RESULT, "relative error"),
    ("writes_nothing", FailureClass.WRONG_RESULT, "output not written"),
    ("mutates_input", FailureClass.WRONG_RESULT, "input 'a' was modified"),
    ("cached_output", FailureClass.WRONG_RESULT, "relative error"),
]


@pytest.mark.parametrize("name, failure, words", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_candidate_is_classified_and_the_pool_survives(evaluator, name, failure, words):
    verdict = evaluator.check(program(name))
    assert verdict.failure == failure, verdict.message
    assert words in verdict.message
    assert_host_passes(evaluator)


def test_cached_output_fails_on_the_second_seed_only_because_it_replays(evaluator, monkeypatch):
    shape = evaluator.workload.check_shapes(WORLD)[0]
    monkeypatch.setattr(evaluator_module, "fresh_seed_base", lambda: 1000)  # seeds 1000, 1001, 1002
    verdict = evaluator.check(program("cached_output"), [shape])
    assert verdict.failure == FailureClass.WRONG_RESULT and verdict.seed == 1001, verdict.message
    recomputing = program("cached_output").replace('if state["cached"] is None:', "if True:")
    assert evaluator.check(recomputing, [shape]).ok


def test_work_left_on_an_unjoined_stream_passes_the_check_but_is_suspect_when_timed(pool, workload):
    evaluator = Evaluator(pool, workload, warmup=2, iters=10, job_timeout_s=300)
    assert evaluator.check(program("escapes_timer")).ok  # the device-wide sync waits for the side stream
    shape = workload.parse_shape("4096x4096x4096", WORLD)
    bench = evaluator.benchmark({"escapes": program("escapes_timer"), "host": workload.program_text("host")}, shape)
    assert bench.programs["escapes"].verdict.failure == FailureClass.SUSPECT, bench.programs["escapes"].verdict
    assert bench.programs["host"].verdict.ok, bench.programs["host"].verdict.message


def test_calibrated_rates_are_plausible_for_hopper(pool):
    rates = calibrate(pool)
    assert 2e14 < rates.matmul_flops_per_s < 1.2e15, rates
    assert 5e10 < rates.link_bytes_per_s < 1e12, rates
    assert 1e12 < rates.hbm_bytes_per_s < 6e12, rates


def test_seed_against_the_baselines(pool, workload):
    rates = calibrate(pool)
    evaluator = Evaluator(pool, workload, rates=rates, job_timeout_s=300)
    shape = workload.parse_shape("8192x8192x8192", WORLD)
    result: EvalResult = evaluator.evaluate(workload.program_text("seed"), shape)
    print(json.dumps(asdict(result)["baselines"], default=str)[:2000])
    assert result.verdict.ok, result.verdict.message
    assert result.baseline == "host" and result.fitness > 0
    host = result.baselines["host"]
    assert math.isclose(result.fitness, host.median_us / result.candidate.median_us)
    assert result.floor_us < min(host.median_us, result.candidate.median_us)
    assert json.loads(json.dumps(asdict(result)))["verdict"]["ok"]
    # memory beyond inputs and output: the seed's symmetric gather buffer holds all of A (W x a
    # shard, 2 MiB-rounded windows), the host baseline its gathered A; both well under 1 GiB here
    gathered = 8192 * 8192 * 2
    assert gathered <= result.candidate.memory_bytes < (1 << 30), result.candidate.memory_bytes
    assert gathered <= host.memory_bytes < (1 << 30), host.memory_bytes


def test_host_against_itself_is_near_one(pool, workload):
    """Side-by-side timing of the same program twice: fitness must be about 1 (interleaving and
    rotation give both the same conditions)."""
    evaluator = Evaluator(pool, workload, iters=30, rates=MachineRates(), job_timeout_s=300)
    shape = workload.parse_shape("4096x4096x4096", WORLD)
    result = evaluator.evaluate(workload.program_text("host"), shape)
    assert result.verdict.ok, result.verdict.message
    assert 0.9 < result.fitness < 1.1, result.fitness
