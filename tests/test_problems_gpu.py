"""The problem judge on one GPU (W = 1, NCCL): our own problem against itself, a wrong solution, one
returning another trial's output and one doing the work twice, told apart as on CPU
(test_problems_cpu.py). At W = 1 the CPU suite's wrong solution (no all-gather) is right, so the
wrong one here is off by 1 %, ten times the problem's tolerance. The twice-work one reads about
half: the judge times what the GPU does, not a wait per call, and holds no more memory after them
than before (its programs' buffers freed once they are killed). The reference workers hand their
draws over on the GPU and get the memory back once the judge lets go."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from commweave.problems.format import load_problem
from commweave.problems.judge import judge, probe
from commweave.problems.service import ReferenceWorkers
from commweave.runtime.pool import WorkerPool

HERE = Path(__file__).parent / "problems"
OWN = HERE / "allgather_matmul.py"
SOLUTIONS = HERE / "solutions"
WRONG_AT_ONE_RANK = ("import torch\nimport torch.distributed as dist\n\n\n"
                     "def solution(a, b):\n"
                     "    parts = [torch.empty_like(a) for _ in range(dist.get_world_size())]\n"
                     "    dist.all_gather(parts, a)\n"
                     "    return (torch.cat(parts) @ b) * 1.01\n")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs 1 CUDA GPU")
def test_judge_tells_right_wrong_stale_and_slow_apart_on_one_gpu() -> None:
    """1 GPU."""
    problem = load_problem(OWN)
    with WorkerPool(1, "cuda", job_timeout_s=300) as pool:
        layout = probe(pool, problem)
        assert layout.fixed and layout.out == (1024 * 1024 + 1,) and all(layout.constant)
        itself = judge(pool, problem, OWN.read_text(), warmup=3, iters=10, layout=layout)
        assert itself.ok and 0.8 < itself.speedup < 1.25, itself
        allocated = pool.run("program_jobs:device_memory").values[0]
        for text in (WRONG_AT_ONE_RANK, (SOLUTIONS / "stale.py").read_text()):
            verdict = judge(pool, problem, text, warmup=1, iters=2, layout=layout)
            assert not verdict.ok and verdict.failure.startswith("wrong_result"), verdict
        slow = judge(pool, problem, (SOLUTIONS / "slow.py").read_text(), warmup=3, iters=10, layout=layout)
        assert slow.ok and 0.4 < slow.speedup < 0.7, slow  # the product twice, the wrapper's result conversion once
        grew = (pool.run("program_jobs:device_memory").values[0] - allocated) >> 20
        assert grew < 256, f"the judge holds {grew} MiB more after three more judges (its programs' buffers?)"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs 1 CUDA GPU")
def test_reference_workers_hand_draws_over_on_the_gpu_and_get_their_memory_back() -> None:
    """1 GPU. A draw's tensors and a reference's result arrive on the judge's GPU (CUDA IPC, no
    trip through the host), the same values for the same seed; once the workers' memory has settled (4
    requests of 16 draws of 8 MiB), 36 more requests, taken and let go, leave it where it was (the
    worker frees what the judge has let go of)."""
    workers = ReferenceWorkers(1, "cuda")
    try:
        workers.load(load_problem(OWN))
        tensors = workers.draws([7, 8], 0)[0][0]
        again = workers.draws([7], 0)[0][0]
        assert sorted(tensors) == sorted(again) and len(tensors) == 2
        for name, tensor in tensors.items():
            assert tensor.device == torch.device("cuda", 0) and tensor.shape == (1024, 1024)
            assert torch.equal(tensor, again[name]) and tensor.abs().sum() > 0
        result = workers.request("reference", 7, 0)  # at one rank: A @ B, then the constant 1.0
        expected = torch.cat([(tensors["t0"] @ tensors["t1"]).flatten(), torch.ones(1, device="cuda")])
        assert result.device == torch.device("cuda", 0) and torch.allclose(result, expected, rtol=1e-3, atol=1e-2)
        del tensors, again, result
        free = []
        for first in range(0, 640, 16):
            draws = workers.draws(list(range(first, first + 16)), 0)
            assert all(t.is_cuda for draw in draws for t in draw[0].values())
            del draws
            free.append(torch.cuda.mem_get_info()[0])
        assert free[3] - free[-1] < (128 << 20), f"{(free[3] - free[-1]) >> 20} MiB more in use after 576 more draws"
    finally:
        workers.close()
