"""The runtime on real GPUs: comm init, windows, device communicators, an LSA all-reduce vs torch."""

from __future__ import annotations

import pytest
import torch

from commweave.runtime import WorkerPool

pytestmark = pytest.mark.gpu
WORLD = min(torch.cuda.device_count(), 4)
needs_gpus = pytest.mark.skipif(WORLD < 2, reason="needs at least 2 CUDA GPUs")


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(WORLD, device="cuda", job_timeout_s=120) as p:
        yield p


@needs_gpus
def test_probe_reports_lsa_team_and_versions(pool):
    result = pool.run("commweave.runtime.selftest:probe")
    assert result.ok, result.first_failure()
    for rank, info in enumerate(result.values):
        assert info["rank"] == rank
        assert info["lsa"] and info["lsa_size"] == WORLD and info["n_ranks"] == WORLD
        assert info["nccl_loaded"] == info["nccl_torch"], "we must bind the libnccl torch loaded"
        assert isinstance(info["gin"], bool) and (info["gin"] or info["gin_reason"])


@needs_gpus
@pytest.mark.parametrize("count", [1, 1000, 1 << 20, (1 << 20) + 3])
def test_lsa_allreduce_matches_torch(pool, count):
    result = pool.run("commweave.runtime.selftest:lsa_allreduce", count=count, seed=count)
    assert result.ok, result.first_failure()
    assert all(v["ok"] for v in result.values), result.values


@needs_gpus
def test_windows_are_reused_across_candidates_and_pool_stays_alive(pool):
    first = pool.run("commweave.runtime.selftest:lsa_allreduce", count=4096)
    second = pool.run("commweave.runtime.selftest:lsa_allreduce", count=4096, seed=1)
    assert first.ok and second.ok
    assert [v["pid"] for v in first.values] == [v["pid"] for v in second.values], "workers must persist"


@needs_gpus
def test_triton_kernel_reads_a_peer_window_through_peer_ptrs(pool):
    pytest.importorskip("triton")
    result = pool.run("commweave.runtime.selftest:triton_peer_read")
    assert result.ok, result.first_failure()
    assert all(v["ok"] for v in result.values), result.values


@needs_gpus
def test_call_graphs_replay_on_new_data_and_evict(pool):
    result = pool.run("commweave.runtime.selftest:call_graphs_replay")
    assert result.ok, result.first_failure()
    assert all(v["ok"] and v["kept"] == 2 for v in result.values), result.values


@needs_gpus
def test_hold_stream_waits_for_release_or_its_timeout(pool):
    result = pool.run("commweave.runtime.selftest:hold_stream")
    assert result.ok, result.first_failure()
    for v in result.values:
        assert v["held"] and v["released"], v
        assert v["timeout_s"] < 1.0, v


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs 1 CUDA GPU")
def test_a_judge_gives_a_finished_jobs_memory_back_to_the_device():
    """1 GPU. A judge that cached what its largest job used would leave the next programs (their
    own processes) without it: PKB problems ran out of memory beside a judge holding 60 GB."""
    from worker_env import worker_env

    with WorkerPool(1, device="cuda", job_timeout_s=120, env=worker_env()) as one:
        held = one.run("runtime_jobs:allocate_and_drop", nbytes=4 << 30)
        after = one.run("runtime_jobs:reserved_bytes")
    assert held.ok and after.ok, (held.first_failure(), after.first_failure())
    assert held.values[0] >= 4 << 30  # torch kept the dropped block cached inside the job
    assert after.values[0] < 1 << 30, f"{after.values[0] / 2**30:.1f} GiB still reserved after the job"


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs 1 CUDA GPU")
def test_a_judge_frees_what_a_finished_jobs_reference_cycles_hold():
    """1 GPU. A job's objects that point at each other outlive it until Python's cycle collector
    runs, rarely: a search's judge lost most of an H100 in 8 candidates that way (its batches shrank
    to one call, and its times to the crossing). A judge collects when tensors outlive a job."""
    from worker_env import worker_env

    with WorkerPool(1, device="cuda", job_timeout_s=120, env=worker_env()) as one:
        held = one.run("runtime_jobs:leave_a_cycle", nbytes=4 << 30)
        after = one.run("runtime_jobs:reserved_bytes")
    assert held.ok and after.ok, (held.first_failure(), after.first_failure())
    assert held.values[0] >= 4 << 30
    assert after.values[0] < 1 << 30, f"{after.values[0] / 2**30:.1f} GiB still held after the job"
