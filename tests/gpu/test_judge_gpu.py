"""The judge on one GPU: programs run in program processes that share the judge's buffers by CUDA
IPC and are timed by CUDA events on the judge's stream (their 'go' and 'done' IPC events), so an
honest copy of the baseline measures 1.0 and a memo keyed on addresses fails.

Run on the GPU machine with `pytest -m gpu tests/gpu/test_judge_gpu.py` (needs 1 GPU)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
import torch

from commweave.evaluate import CANDIDATE, Evaluator, FailureClass
from commweave.runtime import WorkerPool

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))
from toy_workload import ToyGatherMatmul  # noqa: E402
from worker_env import worker_env  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs 1 CUDA GPU")]
TOY = ToyGatherMatmul()
SHAPE = TOY.make_shape(2048, 2048, 2048)  # float32: a fraction of a millisecond of GEMM per call on an H200


def program(name: str) -> str:
    return (TESTS / "programs_cpu" / f"{name}.py").read_text()


@pytest.fixture(scope="module")
def evaluator():
    with WorkerPool(1, device="cuda", job_timeout_s=300, env=worker_env()) as pool:
        yield Evaluator(pool, TOY, warmup=5, iters=40)


def test_programs_are_judged_through_cuda_ipc(evaluator):
    assert evaluator.check(program("host")).ok
    assert evaluator.check(program("wrong_values")).failure == FailureClass.WRONG_RESULT
    assert evaluator.check(program("mutates_input")).failure == FailureClass.WRONG_RESULT


def test_an_honest_copy_of_the_baseline_measures_one_on_one_gpu(evaluator):
    ratios = []
    for _ in range(3):
        bench = evaluator.benchmark({CANDIDATE: program("host"), "host": program("host")}, SHAPE)
        assert all(t.verdict.ok for t in bench.programs.values()), bench
        ratios.append(bench.programs["host"].median_us / bench.programs[CANDIDATE].median_us)
    assert abs(statistics.median(ratios) - 1.0) <= 0.05, ratios


def test_memoising_by_address_fails_on_the_gpu(evaluator):
    bench = evaluator.benchmark({"memo": program("memo_by_address"), "host": program("host")}, SHAPE)
    assert bench.programs["memo"].verdict.failure == FailureClass.WRONG_RESULT, bench.programs["memo"].verdict
    assert bench.programs["host"].verdict.ok
