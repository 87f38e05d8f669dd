"""The CUDA part of the red-team corpus (tests/redteam_gpu/*.py) on ONE GPU, through the
Evaluator with the toy workload: work left running after return, a late write on a side stream,
an illegal address after setup, a huge allocation, memoising per address, patched CUDA timing.
Each must fail with the class it deserves (fitness 0), and the next honest program must pass with
about 1.0x against the identical baseline on the same pool.

Run on the GPU machine: `pytest -m gpu tests/test_redteam_gpu.py` (needs 1 CUDA GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from commweave.contracts.program import parse_program
from commweave.evaluate import Evaluator, FailureClass
from commweave.runtime import WorkerPool, confine
from toy_workload import ToyGatherMatmul
from worker_env import worker_env

needs_one_gpu = pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs 1 CUDA GPU")

TESTS = Path(__file__).parent
CORPUS = TESTS / "redteam_gpu"
TOY = ToyGatherMatmul()
SHAPE = TOY.make_shape(256, 256, 256)
F = FailureClass
EXPECTED: dict[str, set[FailureClass]] = {
    "gpu_returns_early": {F.SUSPECT, F.WRONG_RESULT},
    "gpu_side_stream_late_write": {F.SUSPECT, F.WRONG_RESULT},
    "gpu_illegal_address": {F.ILLEGAL_ADDRESS},
    "gpu_huge_allocation": {F.RUNTIME_ERROR},
    "gpu_memo_by_address": {F.WRONG_RESULT},
    "gpu_patch_timing": {F.WRONG_RESULT},
}


@pytest.fixture(scope="module")
def evaluator():
    with WorkerPool(1, device="cuda", job_timeout_s=120, env=worker_env()) as pool:
        yield Evaluator(pool, TOY, warmup=3, iters=20, job_timeout_s=120)


def test_the_gpu_corpus_parses_and_every_program_has_an_expectation():
    names = sorted(p.stem for p in CORPUS.glob("*.py"))
    assert names == sorted(EXPECTED)
    for name in names:
        parse_program((CORPUS / f"{name}.py").read_text())


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.gpu
@needs_one_gpu
def test_hostile_cuda_program_fails_and_the_next_honest_one_passes(evaluator, name):
    result = evaluator.evaluate((CORPUS / f"{name}.py").read_text(), SHAPE)
    assert result.fitness == 0 and not result.verdict.ok, f"{name} passed: {result.verdict.message}"
    assert result.verdict.failure in EXPECTED[name], f"{name}: {result.verdict.failure}: {result.verdict.message}"
    honest = evaluator.evaluate((TESTS / "programs_cpu" / "host.py").read_text(), SHAPE)
    assert honest.verdict.ok, f"after {name}: {honest.verdict.message}"
    assert 0.5 < honest.fitness < 2.0, f"after {name}: the baseline-equal program measured {honest.fitness:.2f}x"


@pytest.mark.gpu
@needs_one_gpu
def test_cuda_starts_under_the_confinement_program_processes_get():
    """A fresh interpreter confined as a program process (network namespace + Landlock) runs a CUDA
    kernel; if not, the message names which pieces CUDA can and cannot live with."""
    full = confine.probe_cuda(["everything"])[0]
    if not full.in_force:
        lines = "\n".join(c.line() for c in confine.probe_cuda())
        pytest.fail(f"CUDA does not start under full confinement:\n{lines}")
