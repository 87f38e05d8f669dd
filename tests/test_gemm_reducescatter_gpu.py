"""gemm-reducescatter on GPUs, through the evaluator's checks (poisoned outputs, fresh inputs for each of
three seeds on one state, so eager calls, graph captures and replays are all judged).

One GPU: every program at W = 1 (the seed is the plain GEMM there), the cascade's benchmark, and
the seed's reduction kernel itself over a symmetric window (one source: addressing, alignment
fallbacks and coverage on the device; its sums are checked on the host by the CPU suite).
2, 4 and 8 GPUs: the seed in its variants and the baselines, each test skipped without enough GPUs.
Run with `pytest -m gpu tests/test_gemm_reducescatter_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from commweave.contracts.program import load_program, with_config
from commweave.contracts.verdict import FailureClass
from commweave.evaluate import Evaluator
from commweave.runtime import WorkerPool
from commweave.workloads.gemm_reducescatter.workload import GemmReduceScatter

pytestmark = pytest.mark.gpu
WL = GemmReduceScatter()


def _evaluator(world: int):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    pool = WorkerPool(world, device="cuda", job_timeout_s=300)
    return pool, Evaluator(pool, WL, job_timeout_s=180)


@pytest.fixture(scope="module")
def one_gpu():
    pool, evaluator = _evaluator(1)
    with pool:
        yield evaluator


@pytest.fixture(scope="module", params=[2, 4, 8], ids=lambda w: f"{w}gpus")
def gpus(request):
    pool, evaluator = _evaluator(request.param)
    with pool:
        yield evaluator


def _shapes(world: int) -> list:
    return [*WL.check_shapes(world), WL.parse_shape("8192x8192x8192", world)]


# -- one GPU --------------------------------------------------------------------------------------
def test_programs_at_one_rank(one_gpu: Evaluator) -> None:
    for name in ("seed", "host"):
        verdict = one_gpu.check(WL.program_text(name), _shapes(1))
        assert verdict.ok, f"{name}: {verdict.message}"
    async_tp = one_gpu.check(WL.program_text("torch_async_tp"))
    assert async_tp.failure == FailureClass.UNAVAILABLE and "one rank" in async_tp.message, async_tp.message


def test_seed_benchmarked_at_one_rank(one_gpu: Evaluator) -> None:
    result = one_gpu.evaluate(WL.program_text("seed"), WL.parse_shape("4096x4096x4096", 1))
    assert result.verdict.ok and result.candidate.verdict.ok and result.fitness > 0, result.verdict.message
    assert result.baseline == "host"


def reduce_kernel_job(ctx, cases: list[tuple[int, int, int, int, int]]) -> list[str]:
    """Worker job (one rank): for each (rows, n, first row, out shift, wait) the seed's cw_rs_reduce
    over rows [first, first + rows) of a [first + rows + 1, n] bf16 view of a symmetric window into a poisoned
    output starting `out shift` elements into its storage; the cases whose output differs from the
    piece (a one-source sum is the piece itself) or that wrote outside it."""
    module = load_program(with_config(WL.program_text("seed"), comm_ctas=3, threads=128), "seed")
    kernels = ctx.compile(module.CUDA_SRC, "gemm_reducescatter_seed")
    reduce, barrier = kernels.kernel("cw_rs_reduce"), kernels.kernel("cw_rs_barrier")
    dc = ctx.dev_comm(lsa_barriers=1)
    flags = ctx.symmetric((4,), torch.int64)
    window = ctx.symmetric((max((first + rows + 1) * n for rows, n, first, _, _ in cases),), torch.bfloat16, zero=False)
    wrong = []
    for rows, n, first, shift, wait in cases:
        part = window[:(first + rows + 1) * n].view(first + rows + 1, n)
        part.copy_(torch.randn(part.shape, device=ctx.device).to(torch.bfloat16))
        storage = torch.full((rows * n + shift + 16,), -7.0, dtype=torch.bfloat16, device=ctx.device)
        out = storage[shift:shift + rows * n].view(rows, n)
        win = ctx.window(part)
        barrier.launch(1, 32, [dc])
        reduce.launch(3, 128, [win, win.offset + first * n * 2, out, rows * n, flags, 0, 1, wait, 0, 1])
        ctx.synchronize()
        outside = torch.cat([storage[:shift], storage[shift + rows * n:]])
        if not torch.equal(out, part[first:first + rows]) or not bool((outside == -7.0).all()):
            wrong.append(f"rows {rows} n {n} first {first} shift {shift} wait {wait}")
    ctx.end_candidate()
    return wrong


def test_reduction_kernel_on_one_gpu(one_gpu: Evaluator) -> None:
    cases = [(rows, n, first, shift, wait) for rows in (1, 3, 67, 512) for n in (203, 1024, 8) for first in (0, 1, 5)
             for shift in (0, 1, 4, 8) for wait in (0, 1)]
    result = one_gpu.pool.run("test_gemm_reducescatter_gpu:reduce_kernel_job", cases=cases)
    assert result.ok, result.first_failure()
    assert result.values[0] == []


# -- 2, 4 and 8 GPUs ------------------------------------------------------------------------------
def test_baselines_on_gpus(gpus: Evaluator) -> None:
    host = gpus.check(WL.program_text("host"), _shapes(gpus.world_size))
    assert host.ok, host.message
    async_tp = gpus.check(WL.program_text("torch_async_tp"), _shapes(gpus.world_size))
    assert async_tp.ok or async_tp.failure == FailureClass.UNAVAILABLE, async_tp.message


@pytest.mark.parametrize("config", [
    {},  # the seed as it is: 4 pieces, staggered, kernel waits, carveout, graph
    dict(chunks=1),  # sync peer: one piece per block
    dict(chunks=3, order="aligned", comm_ctas=1, threads=128),
    dict(chunks=100, wait="stream", graph=False, carveout=False),  # empty pieces at the small shapes
    dict(overlap=False),  # placement deferred, sync global: the conservative set
], ids=["seed", "peer", "aligned", "stream-eager", "deferred"])
def test_seed_on_gpus(gpus: Evaluator, config: dict) -> None:
    text = with_config(WL.program_text("seed"), **config) if config else WL.program_text("seed")
    verdict = gpus.check(text, _shapes(gpus.world_size))
    assert verdict.ok, f"{config}: {verdict.message}"


def test_seed_benchmarked_beside_the_baselines(gpus: Evaluator) -> None:
    result = gpus.evaluate(WL.program_text("seed"), WL.parse_shape("8192x8192x8192", gpus.world_size))
    assert result.verdict.ok and result.candidate.verdict.ok and result.fitness > 0, result.verdict.message
    assert result.baseline == "host"
