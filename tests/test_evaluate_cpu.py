"""The cascade on a 2-rank CPU pool (gloo): correct, broken, cheating and hostile programs are
classified, and the same pool keeps judging the correct program correctly after each one. Every
program runs in program processes of its own, never in the judges."""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict
from pathlib import Path

import pytest

import commweave.evaluate.evaluator as evaluator_module
from commweave.evaluate import CANDIDATE, EvaluationError, Evaluator, FailureClass, MachineRates, calibrate
from commweave.evaluate.timing import MAX_BATCH
from commweave.runtime import WorkerPool
from toy_workload import (
    ToyGatherMatmul, ToyOnlyInTheParent, ToyWithoutBaseline, ToyWithTwoBaselines, ToyWithUnavailableBaseline,
    ToyZeroReference,
)
from worker_env import worker_env

TESTS = Path(__file__).parent
PROGRAMS = TESTS / "programs_cpu"
TOY = ToyGatherMatmul()
BENCH_SHAPE = TOY.make_shape(64, 64, 64)
MAX_TIMING_LOAD = 2.5  # runnable processes per core above which CPU timings are too noisy to compare to 5 %


def program(name: str) -> str:
    return (PROGRAMS / f"{name}.py").read_text()


def redteam(name: str) -> str:
    """A program of the red-team corpus (tests/redteam), its process marker filled in."""
    return (TESTS / "redteam" / f"{name}.py").read_text().replace("__MARKER__", f"cw-evaluate-cpu-{os.getpid()}")


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(2, device="cpu", job_timeout_s=60, env=worker_env()) as pool:
        yield pool


@pytest.fixture(scope="module")
def evaluator(pool):
    return Evaluator(pool, TOY, warmup=2, iters=10)


def assert_host_still_passes(evaluator: Evaluator) -> None:
    verdict = evaluator.check(program("host"))
    assert verdict.ok, verdict.message


def test_correct_program_passes_every_shape_and_seed(evaluator):
    verdict = evaluator.check(program("host"))
    assert verdict.ok, verdict.message
    assert "3 seeds on 2 shapes" in verdict.message


BROKEN = [
    # program, class, words in the message, failing rank (None: any)
    ("raises", FailureClass.RUNTIME_ERROR, "ValueError: rank 1 lost its way", 1),
    ("setup_raises", FailureClass.RUNTIME_ERROR, "setup() raised MemoryError", 0),
    ("wrong_values", FailureClass.WRONG_RESULT, "relative error 0.001 exceeds tolerance", 0),
    ("writes_nothing", FailureClass.WRONG_RESULT, "output not written: 42 of 42 elements", 0),
    ("writes_nan", FailureClass.NAN, "1 NaN/Inf of 42", 1),
    ("mutates_input", FailureClass.WRONG_RESULT, "input 'b' was modified", 0),
    ("cached_output", FailureClass.WRONG_RESULT, "relative error", 0),
    ("fake_illegal_address", FailureClass.ILLEGAL_ADDRESS, "illegal memory access", None),
    ("worker_exit", FailureClass.RUNTIME_ERROR, "exit code 7", 1),
    ("cuda_compile_error", FailureClass.COMPILE_ERROR, "undeclared_factor", None),
    ("unavailable", FailureClass.UNAVAILABLE, "needs hardware no machine has", 0),
]


@pytest.mark.parametrize("name, failure, words, rank", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_program_is_classified_and_the_pool_survives(evaluator, name, failure, words, rank):
    verdict = evaluator.check(program(name))
    assert verdict.failure == failure, verdict.message
    assert not verdict.ok and words in verdict.message
    if rank is not None:
        assert verdict.rank == rank, verdict.message
    assert_host_still_passes(evaluator)


def test_an_ordinary_exception_costs_no_pool_restart(evaluator):
    restarts = evaluator.pool.restarts
    assert evaluator.check(program("raises")).failure == FailureClass.RUNTIME_ERROR
    assert evaluator.check(program("setup_raises")).failure == FailureClass.RUNTIME_ERROR
    assert evaluator.pool.restarts == restarts


def test_failures_name_shape_and_seed(evaluator):
    verdict = evaluator.check(program("wrong_values"))
    assert verdict.shape == "3x5x7" and verdict.seed is not None
    assert f"shape 3x5x7, seed {verdict.seed}" in verdict.message


def test_cached_output_passes_its_first_run_and_fails_the_second(evaluator, monkeypatch):
    monkeypatch.setattr(evaluator_module, "fresh_seed_base", lambda: 1000)  # seeds 1000, 1001, 1002
    verdict = evaluator.check(program("cached_output"), [TOY.make_shape(3, 5, 7)])
    assert verdict.failure == FailureClass.WRONG_RESULT
    assert verdict.seed == 1001 and verdict.rank == 0


def test_seeds_are_fresh_on_every_call(evaluator):
    seeds = {evaluator.check(program("wrong_values")).seed for _ in range(3)}
    assert len(seeds) == 3


def test_deadlock_times_out_and_the_pool_recovers(pool):
    short = Evaluator(pool, TOY, job_timeout_s=5)
    restarts = pool.restarts
    verdict = short.check(program("deadlock"))
    assert verdict.failure == FailureClass.TIMEOUT, verdict.message
    assert "no answer within" in verdict.message and "killed" in verdict.message
    assert pool.restarts == restarts  # the judges killed the program's processes themselves
    assert_host_still_passes(short)


def test_judges_killed_mid_job_leave_no_folder(tmp_path, monkeypatch):
    """A job past its time limit gets its judges killed (the pool restarts) while its program
    processes run: their job folder, private folders and rendezvous go with the pool's folder."""
    import tempfile

    from commweave.evaluate.evaluator import CHECK_JOB

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the judges' temp folder (before the fix: theirs alone)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the pool's
    with WorkerPool(2, device="cpu", job_timeout_s=60, env=worker_env()) as pool:
        ev = Evaluator(pool, TOY)
        result = pool.run(CHECK_JOB, timeout_s=8, budget_s=600, workload=ev.workload_ref, text=program("deadlock"),
                          name=CANDIDATE, shapes=TOY.check_shapes(2)[:1], seeds=[1])
        assert result.restarted, result
        left = [p.name for p in tmp_path.iterdir()]
        assert len(left) == 1 and left[0].startswith("cw_pool_"), left  # the new pool's, nothing else
    assert list(tmp_path.iterdir()) == []


def test_syntax_error_never_reaches_the_pool(evaluator):
    jobs_before = evaluator.pool._next_job
    verdict = evaluator.check(program("host").replace("def run(ctx, state, inputs, out):", "def run(ctx,"))
    assert verdict.failure == FailureClass.COMPILE_ERROR and "syntax error" in verdict.message
    assert evaluator.pool._next_job == jobs_before


def test_evaluate_correct_candidate(evaluator):
    result = evaluator.evaluate(program("host"), BENCH_SHAPE)
    assert result.verdict.ok, result.verdict.message
    assert result.baseline == "host" and result.fitness > 0
    assert "3 seeds on 3 shapes: 3x5x7, 16x8x12, 64x64x64" in result.verdict.message
    assert result.candidate is not None and len(result.candidate.per_iter_us) == evaluator.iters
    assert result.candidate.min_us <= result.candidate.median_us <= result.candidate.p90_us
    host = result.baselines["host"]
    assert math.isclose(result.fitness, host.median_us / result.candidate.median_us)
    json.dumps(asdict(result))


def test_slow_candidate_scores_below_one(evaluator):
    result = evaluator.evaluate(program("slow"), BENCH_SHAPE)
    assert result.verdict.ok, result.verdict.message
    assert 0 < result.fitness < 0.5, result
    assert result.candidate.median_us > 50_000  # it sleeps 50 ms per call


def test_candidate_failing_its_check_scores_zero(evaluator):
    result = evaluator.evaluate(program("writes_nan"), BENCH_SHAPE)
    assert result.fitness == 0.0 and result.verdict.failure == FailureClass.NAN
    assert result.candidate is None


def test_faster_than_the_floor_is_suspect(pool):
    impossible = Evaluator(pool, TOY, warmup=0, iters=3, rates=MachineRates(1.0, 1.0, 1.0))
    result = impossible.evaluate(program("host"), BENCH_SHAPE)
    assert result.fitness == 0.0 and result.verdict.failure == FailureClass.SUSPECT
    assert "below the physical floor" in result.verdict.message


def test_work_escaping_the_timed_region_is_suspect(evaluator):
    bench = evaluator.benchmark({"escapes": program("escapes_timer"), "host": program("host")}, BENCH_SHAPE)
    escapes, host = bench.programs["escapes"], bench.programs["host"]
    assert escapes.verdict.failure == FailureClass.SUSPECT, escapes.verdict.message
    assert "not ready at the end of the timed region" in escapes.verdict.message
    assert host.verdict.ok and len(host.per_iter_us) == evaluator.iters
    assert bench.input_sets == MAX_BATCH["cpu"]  # tiny inputs: room for the largest batch
    assert 1 <= host.batch <= MAX_BATCH["cpu"] and host.crossing_us >= 0  # the judge's resolution, recorded
    # taken off every batch: the smallest program's crossing, which no program can raise for itself
    assert 0 <= host.subtracted_us == escapes.subtracted_us <= min(host.crossing_us, escapes.crossing_us) + 1e-6
    assert host.hold_expired == 0  # (a GPU hold; on CPU the program is stopped while the judge fills its inputs)
    assert_host_still_passes(evaluator)


def test_benchmark_reports_compile_failures_and_times_the_rest(evaluator):
    bench = evaluator.benchmark({"bad": "def run(:", "host": program("host")}, BENCH_SHAPE)
    assert bench.programs["bad"].verdict.failure == FailureClass.COMPILE_ERROR
    assert bench.programs["bad"].median_us is None
    assert bench.programs["host"].verdict.ok and bench.programs["host"].median_us > 0
    assert list(bench.programs) == ["bad", "host"]


def test_unavailable_baseline_is_reported_and_skipped(pool):
    result = Evaluator(pool, ToyWithUnavailableBaseline(), warmup=1, iters=5).evaluate(program("host"), BENCH_SHAPE)
    assert result.verdict.ok, result.verdict.message
    assert result.baseline == "host" and result.fitness > 0
    assert result.baselines["unavailable"].verdict.failure == FailureClass.UNAVAILABLE
    assert list(result.baselines) == ["unavailable", "host"]


def test_a_search_times_only_the_fitness_baseline_beside_a_candidate(pool):
    result = Evaluator(pool, ToyWithTwoBaselines(), warmup=1, iters=3, fitness_baseline_only=True).evaluate(
        program("host"), BENCH_SHAPE)
    assert result.verdict.ok, result.verdict.message
    assert result.baseline == "host" and list(result.baselines) == ["host"]  # 'slow' (50 ms a call) not run
    skipped_first = Evaluator(pool, ToyWithUnavailableBaseline(), warmup=1, iters=3,
                              fitness_baseline_only=True).evaluate(program("host"), BENCH_SHAPE)
    assert skipped_first.baseline == "host" and list(skipped_first.baselines) == ["unavailable", "host"]


def test_a_broken_workload_fails_every_program_as_the_harness(pool):
    verdict = Evaluator(pool, ToyZeroReference()).check(program("host"))
    assert verdict.failure == FailureClass.RUNTIME_ERROR
    assert "harness failed" in verdict.message and "trivial" in verdict.message


def test_no_usable_baseline_raises(pool):
    with pytest.raises(EvaluationError, match="no baseline .* unavailable: this program needs"):
        Evaluator(pool, ToyWithoutBaseline(), warmup=0, iters=2).evaluate(program("host"), BENCH_SHAPE)


def test_workload_that_workers_cannot_build_raises(pool):
    with pytest.raises(EvaluationError, match="cannot be built in this worker"):
        Evaluator(pool, ToyOnlyInTheParent()).check(program("host"))


def test_calibrate_measures_positive_rates(pool):
    rates = calibrate(pool)
    for value in (rates.matmul_flops_per_s, rates.link_bytes_per_s, rates.hbm_bytes_per_s):
        assert math.isfinite(value) and value > 0


class ClashingBaselineName(ToyGatherMatmul):
    baselines = (CANDIDATE,)


def test_workload_classes_must_be_importable_and_not_reuse_the_candidates_name(pool):
    class Local(ToyGatherMatmul):
        pass

    with pytest.raises(ValueError, match="module level"):
        Evaluator(pool, Local())
    with pytest.raises(ValueError, match="reserved"):
        Evaluator(pool, ClashingBaselineName())


# -- hostile programs: what reached the judge before program processes ------------------------------
def test_memoising_by_sampled_values_never_hits(evaluator):
    """Its teardown raises if any call found its key again: every timed set holds fresh values."""
    bench = evaluator.benchmark({"memoised": program("memoised"), "host": program("host")}, BENCH_SHAPE)
    assert bench.programs["memoised"].verdict.ok, bench.programs["memoised"].verdict.message
    assert bench.programs["host"].verdict.ok


def test_memoising_by_address_fails_the_benchmark(evaluator):
    bench = evaluator.benchmark({"memo": program("memo_by_address"), "host": program("host")}, BENCH_SHAPE)
    memo = bench.programs["memo"].verdict
    assert memo.failure == FailureClass.WRONG_RESULT and "benchmark batch" in memo.message, memo.message
    assert bench.programs["host"].verdict.ok and len(bench.programs["host"].per_iter_us) == evaluator.iters


def test_a_patched_torch_stays_in_the_candidates_process(evaluator):
    bench = evaluator.benchmark({"patch": program("patches_torch"), "host": program("host")}, BENCH_SHAPE)
    assert bench.programs["patch"].verdict.failure == FailureClass.WRONG_RESULT  # its own later calls
    assert bench.programs["host"].verdict.ok, bench.programs["host"].verdict.message
    assert all(evaluator.pool.run("runtime_jobs:torch_mm_is_pristine").values)  # nor the judges'
    assert_host_still_passes(evaluator)


def test_poisoned_inputs_fail_the_candidate_not_the_baseline(evaluator):
    verdict = evaluator.check(program("poisons_inputs"))
    assert verdict.failure == FailureClass.WRONG_RESULT and "was modified" in verdict.message
    bench = evaluator.benchmark({"poison": program("poisons_inputs"), "host": program("host")}, BENCH_SHAPE)
    assert bench.programs["poison"].verdict.failure == FailureClass.WRONG_RESULT
    assert bench.programs["host"].verdict.ok, bench.programs["host"].verdict.message


def test_a_destroyed_process_group_fails_only_its_program(evaluator):
    restarts = evaluator.pool.restarts
    assert evaluator.check(program("destroys_group")).failure == FailureClass.RUNTIME_ERROR
    assert evaluator.pool.restarts == restarts
    assert_host_still_passes(evaluator)


def test_a_daemon_left_behind_is_tampering(evaluator):
    result = evaluator.evaluate(redteam("spawn_detached"), BENCH_SHAPE)
    assert result.fitness == 0.0 and result.verdict.failure == FailureClass.TAMPERING, result.verdict.message
    assert "to outlive it" in result.verdict.message
    assert_host_still_passes(evaluator)


HONEST_TOLERANCE = 0.05  # an honest copy of the baseline must measure 1.0 to within this
HONEST_BENCHMARKS = (5, 25)  # fewest and most benchmarks of 400 iterations before the verdict


def honest_bias_settled(ratios: list[float]) -> bool | None:
    """True once the mean log ratio lies inside the tolerance by 2 standard errors, False once it
    lies outside by as much, None while the benchmarks cannot yet tell noise from bias (2, not 3:
    with benchmarks spread ~6 % an unbiased copy settles after ~6 of them, not ~14)."""
    if len(ratios) < HONEST_BENCHMARKS[0]:
        return None
    logs = [math.log(r) for r in ratios]
    mean, margin = statistics.fmean(logs), 2 * statistics.stdev(logs) / math.sqrt(len(logs))
    if abs(mean) + margin <= math.log1p(HONEST_TOLERANCE):
        return True
    if abs(mean) - margin > math.log1p(HONEST_TOLERANCE):
        return False
    return None


def test_the_honest_copy_check_waits_for_evidence():
    assert honest_bias_settled([1.0] * 4) is None
    assert honest_bias_settled([0.99, 1.01, 1.0, 1.02, 0.98]) is True
    assert honest_bias_settled([1.2, 1.21, 1.19, 1.2, 1.22]) is False
    assert honest_bias_settled([1.0, 1.16, 1.05, 1.02, 1.08]) is None  # CI's five: keep measuring
    assert honest_bias_settled([0.97, 1.05, 1.01, 0.95, 1.03, 1.0]) is True  # spread ~4 %: six settle it


@pytest.mark.parametrize("world", [1, 2])
def test_an_honest_copy_of_the_baseline_measures_one(world):
    """Timed from the judges' side, a program identical to the baseline scores 1.0 within 5 %.
    Every batch wakes a program process and its judge, so on a small CPU machine one
    benchmark's ratio spreads by about 6 % (scheduling, not the judge): benchmarks are repeated
    until the bias is pinned inside (or outside) the tolerance, and after the most of them the
    median ratio decides. Under heavy load the test says so instead of measuring noise. Two ranks
    need 4 cores: on 2, their judges, programs and gloo share them and a benchmark's ratio spreads
    ~14 % (measured), so pinning 5 % would take ~35 benchmarks (4 minutes) of a CPU suite."""
    if (os.cpu_count() or 1) < 2 * world:
        pytest.skip(f"{world} ranks need {2 * world} cores for a 5 % timing check; this machine has {os.cpu_count()}")
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    if load > MAX_TIMING_LOAD:
        pytest.skip(f"load average {load:.1f} per core (over {MAX_TIMING_LOAD}): timing noise exceeds 5 % here")
    ratios: list[float] = []
    settled = None
    with WorkerPool(world, device="cpu", job_timeout_s=120, env=worker_env()) as p:
        evaluator = Evaluator(p, TOY, warmup=5, iters=40)  # batches of >= 25 ms each
        while settled is None and len(ratios) < HONEST_BENCHMARKS[1]:
            bench = evaluator.benchmark({CANDIDATE: program("host"), "host": program("host")}, BENCH_SHAPE)
            ratios.append(bench.programs["host"].median_us / bench.programs[CANDIDATE].median_us)
            settled = honest_bias_settled(ratios)
    assert settled is not False, f"biased: {ratios}"
    assert settled or abs(statistics.median(ratios) - 1.0) <= HONEST_TOLERANCE, ratios


def test_values_read_ahead_from_the_shared_block_never_come_up(evaluator):
    """Its teardown raises if a call's values were ones it had already seen in another set."""
    bench = evaluator.benchmark({"ahead": program("precomputes_ahead"), "host": program("host")}, BENCH_SHAPE)
    assert bench.programs["ahead"].verdict.ok, bench.programs["ahead"].verdict.message
    assert bench.programs["host"].verdict.ok
