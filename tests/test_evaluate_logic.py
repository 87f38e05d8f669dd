"""The evaluator's pure logic, without workers: checks, merging, timing statistics, floor,
classification of failed jobs, compile stage, and that results serialise to JSON."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from commweave.evaluate import EvaluationError, Evaluator, FailureClass, MachineRates, Verdict, floor_s
from commweave.contracts.verdict import InfrastructureError
from commweave.contracts.poison import poison_, poisoned_mask
from commweave.evaluate.checks import judge_output, modified_inputs, not_ready
from commweave.contracts.result import EvalResult
from commweave.evaluate.evaluator import job_failure
from commweave.evaluate.floor import FLOOR_MARGIN, below_floor
from commweave.evaluate.timing import (
    BATCH_TARGET_S, INTERLEAVE_BLOCK, MAX_BATCH_STRETCH, MAX_INPUT_SETS, batch_size, common_sizes, input_sets_for,
    interleaved_schedule, net_seconds, per_iteration_max, summarize,
)
from commweave.contracts.verdict import merge_rank_verdicts
from commweave.runtime.pool import JobResult, RankFailure, WorkerPool
from commweave.contracts.profile import H200
from commweave.contracts.workload import Cost
from toy_workload import ToyGatherMatmul

PROGRAMS = Path(__file__).parent / "programs_cpu"
GPU_PROGRAMS = Path(__file__).parent / "programs_gpu"


# -- poison and judging -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_poison_is_a_nan_with_our_payload(dtype):
    out = poison_(torch.empty(4, 3, dtype=dtype))
    assert torch.isnan(out).all()
    assert poisoned_mask(out).all()
    assert not poisoned_mask(torch.full((4, 3), float("nan"), dtype=dtype)).any()  # torch's NaN differs
    assert bool(not_ready(out))


def test_poison_refuses_integer_outputs():
    with pytest.raises(TypeError):
        poison_(torch.zeros(3, dtype=torch.int32))


def test_judge_output_classes():
    ref = torch.randn(8, 5)
    assert judge_output(ref.clone(), ref, 1e-4).ok
    partial = ref.clone()
    poison_(partial[2:4])  # rows are contiguous views
    verdict = judge_output(partial, ref, 1e-4)
    assert verdict.failure == FailureClass.WRONG_RESULT and "not written: 10 of 40" in verdict.message
    nan = ref.clone()
    nan[0, 0] = float("inf")
    assert judge_output(nan, ref, 1e-4).failure == FailureClass.NAN
    wrong = judge_output(ref * 1.001, ref, 1e-4)
    assert wrong.failure == FailureClass.WRONG_RESULT and "relative error 0.001" in wrong.message
    assert judge_output(ref * 1.00001, ref, 1e-4).ok


def test_zero_output_fails_and_trivial_reference_is_refused():
    ref = torch.randn(16, 16)
    assert judge_output(torch.zeros_like(ref), ref, 0.5).failure == FailureClass.WRONG_RESULT
    with pytest.raises(ValueError, match="trivial"):
        judge_output(torch.zeros(4, 4), torch.zeros(4, 4), 1e-2)
    with pytest.raises(ValueError, match="shape"):
        judge_output(torch.zeros(4, 4), torch.ones(4, 5), 1e-2)


def test_modified_inputs_compares_bits():
    a, b = torch.randn(3, 3), torch.randn(3)
    pristine = {"a": a.clone(), "b": b.clone()}
    assert modified_inputs({"a": a, "b": b}, pristine) == []
    a[1, 1] = -a[1, 1] if a[1, 1] != 0 else 1.0
    assert modified_inputs({"a": a, "b": b}, pristine) == ["a"]
    zero = torch.zeros(2)
    assert modified_inputs({"z": -zero}, {"z": zero}) == ["z"]  # -0.0 == 0.0, but not bitwise


# -- verdicts ---------------------------------------------------------------------------------------
def test_failed_verdict_message_names_where():
    verdict = Verdict.failed(FailureClass.NAN, "output has NaN", rank=1, shape="3x5x7", seed=42)
    assert verdict.message == "output has NaN (rank 1, shape 3x5x7, seed 42)"
    assert not verdict.ok and verdict.failure is FailureClass.NAN


def test_merge_takes_the_lowest_failing_rank():
    ok = Verdict.passed("fine")
    bad1 = Verdict.failed(FailureClass.WRONG_RESULT, "x", rank=1)
    bad2 = Verdict.failed(FailureClass.NAN, "y", rank=2)
    assert merge_rank_verdicts([ok, bad1, bad2]) is bad1
    assert merge_rank_verdicts([ok, Verdict.passed()]) is ok
    with pytest.raises(ValueError):
        merge_rank_verdicts([])


def _job(status, failures, restarted=True):
    return JobResult(status, [None] * len(failures), failures, elapsed_s=3.0, restarted=restarted)


def test_job_failure_classification():
    timeout = job_failure(_job("timeout", [RankFailure("timeout", "rank 0: no answer"), RankFailure("timeout", "rank 1")]))
    assert timeout.failure == FailureClass.TIMEOUT and "rank 0, 1" in timeout.message and "restarted" in timeout.message
    sticky = job_failure(_job("error", [RankFailure("killed", "rank 0: still running"),
                                        RankFailure("StickyCudaError", "run() raised: CUDA error: an illegal memory access")]))
    assert sticky.failure == FailureClass.ILLEGAL_ADDRESS and sticky.rank == 1
    crashed = job_failure(_job("error", [RankFailure("crashed", "rank 0 worker died (exit code -11)"), None]))
    assert crashed.failure == FailureClass.RUNTIME_ERROR and "exit code -11" in crashed.message
    crashed_sticky = job_failure(_job("error", [RankFailure("crashed", "unspecified launch failure"), None]))
    assert crashed_sticky.failure == FailureClass.ILLEGAL_ADDRESS
    harness = job_failure(_job("error", [RankFailure("HarnessError", "reference() raised"), None], restarted=False))
    assert harness.failure == FailureClass.RUNTIME_ERROR and "harness failed" in harness.message
    with pytest.raises(EvaluationError, match="cannot be built"):
        job_failure(_job("error", [RankFailure("WorkloadError", "workload x cannot be built"), None]))


# -- timing -----------------------------------------------------------------------------------------
def test_per_iteration_max_then_median():
    rank0 = [1.0, 5.0, 2.0, 2.0]
    rank1 = [3.0, 1.0, 2.5, 9.0]
    assert per_iteration_max([rank0, rank1]) == [3.0, 5.0, 2.5, 9.0]
    timing = summarize("p", Verdict.passed(), [[t * 1e-6 for t in rank0], [t * 1e-6 for t in rank1]])
    assert timing.median_us == pytest.approx(4.0)  # median of [3, 5, 2.5, 9], not of all samples
    assert timing.min_us == pytest.approx(2.5) and timing.p90_us == pytest.approx(9.0)
    with pytest.raises(ValueError, match="different numbers"):
        per_iteration_max([[1.0], [1.0, 2.0]])


def test_interleaved_schedule_rotates_blocks():
    schedule = interleaved_schedule(["a", "b"], 7, block=3)
    assert schedule == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2),
                        ("b", 3), ("b", 4), ("b", 5), ("a", 3), ("a", 4), ("a", 5),
                        ("a", 6), ("b", 6)]
    full = interleaved_schedule(["x", "y", "z"], 20)
    for name in "xyz":
        assert [i for n, i in full if n == name] == list(range(20))
    assert full[:INTERLEAVE_BLOCK] == [("x", i) for i in range(INTERLEAVE_BLOCK)]


def test_input_sets_exceed_twice_l2():
    assert input_sets_for(1 << 30) == 2
    assert input_sets_for(16 << 20) * (16 << 20) >= 2 * H200.l2_bytes
    assert input_sets_for(1) == MAX_INPUT_SETS


# -- floor ------------------------------------------------------------------------------------------
def test_floor_is_the_busiest_resource():
    rates = MachineRates(matmul_flops_per_s=1e12, link_bytes_per_s=1e9, hbm_bytes_per_s=1e10)
    assert floor_s(Cost(flops=2e12), rates) == pytest.approx(2.0)
    assert floor_s(Cost(flops=1e12, comm_bytes=3e9, memory_bytes=1e10), rates) == pytest.approx(3.0)
    assert below_floor(1.0, 1.0) is None
    assert below_floor(1.0 - FLOOR_MARGIN / 2, 1.0) is None  # within the noise margin
    suspect = below_floor(0.5, 1.0)
    assert suspect is not None and suspect.failure == FailureClass.SUSPECT and "floor" in suspect.message


def test_default_rates_put_the_gemm_allgather_floor_where_device_md_does():
    """DEVICE.md: at 8192^3 on 4 GPUs the floor is about the GEMM's 350 µs."""
    cost = Cost(flops=2.0 * 8192 * 2048 * 8192, comm_bytes=0.75 * 8192 * 8192 * 2, memory_bytes=0.0)
    assert 300e-6 < floor_s(cost, MachineRates()) < 400e-6


# -- compile stage and results ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def idle_evaluator():
    """An evaluator whose pool is never started: compile() runs in this process only."""
    return Evaluator(WorkerPool(2, device="cpu"), ToyGatherMatmul())


def test_compile_rejects_malformed_programs(idle_evaluator):
    host = (PROGRAMS / "host.py").read_text()
    cases = {
        "syntax": host.replace("def run(ctx, state, inputs, out):", "def run(ctx, state, inputs, out)"),
        "no run": host.replace("def run(", "def execute("),
        "markers": host.replace("# EVOLVE-BLOCK-END", ""),
        "non-literal": host.replace("# EVOLVE-BLOCK-START", '# EVOLVE-BLOCK-START\nCUDA_SRC = "a" + "b"'),
    }
    expected = {"syntax": "syntax error", "no run": "run()", "markers": "markers", "non-literal": "literal"}
    for name, text in cases.items():
        verdict = idle_evaluator.compile(text)
        assert verdict.failure == FailureClass.COMPILE_ERROR, name
        assert expected[name] in verdict.message, (name, verdict.message)
    assert idle_evaluator.compile(host).ok


def test_compile_error_carries_nvccs_log(idle_evaluator):
    verdict = idle_evaluator.compile((PROGRAMS / "cuda_compile_error.py").read_text())
    assert verdict.failure == FailureClass.COMPILE_ERROR
    assert "nvcc failed" in verdict.message and "undeclared_factor" in verdict.message
    assert "is undefined" in verdict.message  # nvcc's own words, verbatim


def test_cpu_workers_need_no_cuda_toolchain(idle_evaluator, monkeypatch):
    """Without nvcc or NCCL's headers (the main install) CPU workers skip the compiles, which they
    would never run; a CUDA pool still says what is missing."""
    import commweave.evaluate.evaluator as evaluator_module
    from commweave.runtime.toolchain import ToolchainError

    def missing(source: str) -> None:
        raise ToolchainError("no NCCL found")

    monkeypatch.setattr(evaluator_module, "compile_cubin", missing)
    program = (PROGRAMS / "cuda_compile_error.py").read_text()
    verdict = idle_evaluator.compile(program)
    assert verdict.ok and "not compiled on CPU workers (no NCCL found)" in verdict.message
    with pytest.raises(ToolchainError, match="no NCCL found"):
        Evaluator(WorkerPool(2, device="cuda"), ToyGatherMatmul()).compile(program)


def test_compiled_cubin_lands_in_the_cache(idle_evaluator):
    from commweave.runtime.compile import compile_cubin

    source = '#include <nccl_device.h>\nextern "C" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }\n'
    program = (PROGRAMS / "host.py").read_text().replace("# EVOLVE-BLOCK-START", f'# EVOLVE-BLOCK-START\nCUDA_SRC = r"""{source}"""')
    assert idle_evaluator.compile(program).ok
    assert compile_cubin(source).cached  # what a worker's ctx.compile will find


@pytest.mark.parametrize("path", sorted(GPU_PROGRAMS.glob("*.py")), ids=lambda p: p.stem)
def test_gpu_test_programs_compile_here(idle_evaluator, path):
    verdict = idle_evaluator.compile(path.read_text())
    assert verdict.ok, verdict.message


def test_failed_compile_gives_fitness_zero_without_running_anything(idle_evaluator):
    result = idle_evaluator.evaluate("not a program", ToyGatherMatmul().make_shape(4, 4, 4))
    assert result.fitness == 0.0 and result.verdict.failure == FailureClass.COMPILE_ERROR
    assert not idle_evaluator.pool.running


def test_results_serialise_to_json():
    timing = summarize("candidate", Verdict.passed(), [[1e-6, 2e-6], [3e-6, 1e-6]])
    result = EvalResult(1.5, Verdict.failed(FailureClass.SUSPECT, "fast", rank=0), "3x5x7", timing, "host",
                        {"host": timing}, 1.25)
    data = json.loads(json.dumps(asdict(result)))
    assert data["verdict"]["failure"] == "suspect"
    assert data["candidate"]["per_iter_us"] == pytest.approx([3.0, 2.0])
    assert math.isclose(data["fitness"], 1.5)


def test_evaluator_validates_its_settings():
    pool = WorkerPool(2, device="cpu")
    with pytest.raises(ValueError, match="seeds"):
        Evaluator(pool, ToyGatherMatmul(), seeds=1)
    with pytest.raises(ValueError, match="iters"):
        Evaluator(pool, ToyGatherMatmul(), iters=0)
    with pytest.raises(ValueError, match="runs on"):
        Evaluator(WorkerPool(3, device="cpu"), ToyGatherMatmul())


def test_with_config_sets_knobs_and_refuses_unknown_ones():
    from commweave.contracts.program import ProgramError, parse_program, with_config

    text = '''# EVOLVE-BLOCK-START
CONFIG = dict(ctas=16, order="a")  # é keeps columns honest
def setup(ctx, shape): return None
def run(ctx, state, inputs, out): out.copy_(inputs["x"])
# EVOLVE-BLOCK-END
'''
    edited = with_config(text, ctas=8, order="b")
    assert "CONFIG = dict(ctas=8, order='b')  # é" in edited
    assert parse_program(edited).functions == parse_program(text).functions
    with pytest.raises(ProgramError, match="no knob threads"):
        with_config(text, threads=1)
    with pytest.raises(ProgramError, match="no module-level CONFIG"):
        with_config("x = 1\n", ctas=1)


def test_judge_output_with_an_untouched_mask():
    import torch

    from commweave.contracts.poison import poison_
    from commweave.evaluate.checks import judge_output, not_ready
    from commweave.contracts.verdict import FailureClass

    ref = torch.arange(1, 9, dtype=torch.float32)
    untouched = torch.tensor([False] * 6 + [True] * 2)
    out = poison_(torch.empty(8))
    out[:6] = ref[:6]
    assert judge_output(out, ref, 0.0, untouched).ok
    assert not bool(not_ready(out, untouched)) and bool(not_ready(out))
    stray = out.clone()
    stray[7] = 8.0  # the right value, but where nothing may be written
    verdict = judge_output(stray, ref, 0.0, untouched)
    assert verdict.failure == FailureClass.WRONG_RESULT and "leave untouched" in verdict.message
    missing = out.clone()
    poison_(missing[:1])
    assert "not written: 1 of 6" in judge_output(missing, ref, 0.0, untouched).message
    with pytest.raises(ValueError, match="mask shape"):
        judge_output(out, ref, 0.0, untouched[:4])


# -- the harness's output buffer --------------------------------------------------------------------
class _FakeContext:
    """What harness_output uses of a RankContext; `symmetric` hands out CPU storage and records calls."""

    def __init__(self, is_cuda: bool):
        self.is_cuda, self.rank, self.world_size, self.device = is_cuda, 1, 2, torch.device("cpu")
        self.calls: list[tuple] = []

    def symmetric(self, shape, dtype, zero=True):
        self.calls.append((tuple(shape), dtype, zero))
        return torch.zeros(shape, dtype=dtype)


class _SymmetricToy(ToyGatherMatmul):
    symmetric_output = True


def test_harness_output_is_symmetric_only_when_asked_on_cuda(monkeypatch):
    from commweave.evaluate import jobs

    shape = ToyGatherMatmul().make_shape(3, 5, 7)
    plain = _FakeContext(is_cuda=True)
    out = jobs.harness_output(plain, ToyGatherMatmul(), shape)  # the default: make_output
    assert not plain.calls and out.shape == (6, 7) and out.dtype == torch.float32
    cpu = _FakeContext(is_cuda=False)
    assert jobs.harness_output(cpu, _SymmetricToy(), shape).shape == (6, 7) and not cpu.calls

    # On CUDA: one window of the largest rank's byte count (a peer's output is bigger here), viewed
    # as make_output's shape and dtype, not zeroed (the harness poisons it).
    agreed = []
    monkeypatch.setattr(jobs, "_harness_group", lambda: None)
    monkeypatch.setattr(jobs.dist, "all_reduce", lambda t, op=None, group=None: (agreed.append(int(t)), t.fill_(1000)))
    gpu = _FakeContext(is_cuda=True)
    out = jobs.harness_output(gpu, _SymmetricToy(), shape)
    assert agreed == [6 * 7 * 4] and gpu.calls == [((1000,), torch.uint8, False)]
    assert out.shape == (6, 7) and out.dtype == torch.float32 and out.is_contiguous()
    assert ToyGatherMatmul.symmetric_output is False


def test_memory_is_the_largest_over_ranks_and_absent_where_not_measured():
    from commweave.evaluate.jobs import RankBench

    ok = Verdict.passed()
    ranks = [RankBench(times={"a": [1e-3], "b": [1e-3]}, verdicts={"a": ok, "b": ok}, memory={"a": 5 << 20}),
             RankBench(times={"a": [2e-3], "b": [1e-3]}, verdicts={"a": ok, "b": ok}, memory={"a": 7 << 20})]
    assert Evaluator._timing("a", ranks, 1e-6).memory_bytes == 7 << 20
    assert Evaluator._timing("b", ranks, 1e-6).memory_bytes is None  # e.g. CPU pools: not measured


# -- blame: the candidate or the machine ------------------------------------------------------------
class _ScriptedPool:
    """A pool whose jobs return prepared results, in order (what the evaluator sees of judges)."""

    world_size, job_timeout_s, restarts = 2, 10.0, 0

    def __init__(self, *results: JobResult):
        self.results = list(results)
        self.jobs: list[str] = []
        self.calls: list[tuple[str, float | None]] = []  # (job function, its time limit)

    def run(self, fn, timeout_s=None, **kwargs):
        self.jobs.append(kwargs.get("name", "bench"))
        self.calls.append((fn, timeout_s))
        return self.results.pop(0)


def _passing_check() -> JobResult:
    from commweave.evaluate.jobs import RankCheck

    return JobResult("ok", [RankCheck(Verdict.passed("fine"), {"start": 1.0}), RankCheck(Verdict.passed(), {"start": 3.0})],
                     [None, None], elapsed_s=1.0)


def _judge_died() -> JobResult:
    return _job("error", [RankFailure("crashed", "rank 0 worker died (exit code -9)"),
                          RankFailure("killed", "rank 1: still running when another rank failed")])


def test_a_judge_dying_under_a_candidate_is_tampering_when_a_fresh_pool_works():
    pool = _ScriptedPool(_judge_died(), _passing_check())
    verdict = Evaluator(pool, ToyGatherMatmul()).check((PROGRAMS / "host.py").read_text())
    assert verdict.failure == FailureClass.TAMPERING and "exit code -9" in verdict.message, verdict.message
    assert pool.jobs == ["candidate", "host"]  # the probe: the first baseline, in a fresh job


def test_a_judge_dying_twice_is_the_machines_failure():
    pool = _ScriptedPool(_judge_died(), _judge_died())
    with pytest.raises(InfrastructureError, match="died"):
        Evaluator(pool, ToyGatherMatmul()).check((PROGRAMS / "host.py").read_text())


def test_program_processes_that_cannot_start_are_the_machines_failure():
    pool = _ScriptedPool(_job("error", [RankFailure("ProgramStartError", "a program process did not start: x"), None]))
    with pytest.raises(InfrastructureError, match="did not start"):
        Evaluator(pool, ToyGatherMatmul()).check((PROGRAMS / "host.py").read_text())


def test_phases_are_the_slowest_ranks():
    evaluator = Evaluator(_ScriptedPool(_passing_check()), ToyGatherMatmul())
    assert evaluator.check((PROGRAMS / "host.py").read_text()).ok
    assert evaluator.phases == {"start": 3.0}


def _bench_job(verdicts: dict[str, Verdict]) -> JobResult:
    from commweave.evaluate.jobs import RankBench

    ranks = [RankBench(input_sets=2, times={n: [1e-3] * 3 for n, v in verdicts.items() if v.ok}, verdicts=dict(verdicts))
             for _ in range(2)]
    return JobResult("ok", ranks, [None, None], elapsed_s=1.0)


def _evaluate_job(verdicts: dict[str, Verdict]) -> JobResult:
    """The candidate passed its checks, then the benchmark gave `verdicts` (one job)."""
    from commweave.evaluate.jobs import RankEvaluation

    ranks = [RankEvaluation(Verdict.passed(), bench) for bench in _bench_job(verdicts).values]
    return JobResult("ok", ranks, [None, None], elapsed_s=1.0)


def test_an_evaluation_starts_its_programs_once():
    """The candidate's checks and its benchmark beside the baselines are one job (program processes
    start once per evaluation, not once per check and once per benchmark), with the time of two;
    the baseline's own check runs once, in the first evaluation."""
    from commweave.evaluate.evaluator import CHECK_JOB, EVALUATE_JOB

    both = {"candidate": Verdict.passed(), "host": Verdict.passed()}
    pool = _ScriptedPool(_passing_check(), _evaluate_job(both), _evaluate_job(both))
    evaluator = Evaluator(pool, ToyGatherMatmul())
    shape = ToyGatherMatmul().make_shape(4, 4, 4)
    for _ in range(2):
        result = evaluator.evaluate((PROGRAMS / "host.py").read_text(), shape)
        assert result.verdict.ok and result.fitness == pytest.approx(1.0), result.verdict.message
    assert pool.calls == [(CHECK_JOB, 10.0), (EVALUATE_JOB, 20.0), (EVALUATE_JOB, 20.0)]


def test_a_candidate_failing_its_checks_is_not_benchmarked():
    from commweave.evaluate.jobs import RankEvaluation

    wrong = Verdict.failed(FailureClass.WRONG_RESULT, "output differs at 3 of 16 elements")
    failed = JobResult("ok", [RankEvaluation(wrong, None), RankEvaluation(Verdict.passed(), None)], [None, None],
                       elapsed_s=1.0)
    pool = _ScriptedPool(_passing_check(), failed)
    result = Evaluator(pool, ToyGatherMatmul()).evaluate((PROGRAMS / "host.py").read_text(),
                                                          ToyGatherMatmul().make_shape(4, 4, 4))
    assert result.fitness == 0.0 and result.verdict.failure == FailureClass.WRONG_RESULT and result.candidate is None


@pytest.mark.parametrize("beside, alone, expected", [
    (Verdict.failed(FailureClass.NAN, "output has 3 NaN"), Verdict.passed(), FailureClass.TAMPERING),
    (Verdict.failed(FailureClass.TIMEOUT, "run(): no answer within 8.0 s"), None, FailureClass.TIMEOUT),
    # a full device is no evidence of intent (PKB #59 beside a judge that held 65 GB): a runtime error
    (Verdict.failed(FailureClass.RUNTIME_ERROR, "run() raised OutOfMemoryError: CUDA out of memory. Tried to "
                    "allocate 128.00 MiB"), Verdict.passed(), FailureClass.RUNTIME_ERROR),
])
def test_a_baseline_failing_only_beside_the_candidate_is_the_candidates_doing(beside, alone, expected):
    shape = ToyGatherMatmul().make_shape(4, 4, 4)
    jobs = [_passing_check(), _evaluate_job({"candidate": Verdict.passed(), "host": beside})]
    if alone is not None:
        jobs.append(_bench_job({"host": alone}))
    pool = _ScriptedPool(*jobs)
    result = Evaluator(pool, ToyGatherMatmul()).evaluate((PROGRAMS / "host.py").read_text(), shape)
    assert result.fitness == 0.0 and result.verdict.failure == expected, result.verdict.message
    assert "'host'" in result.verdict.message and not pool.results


def test_programs_of_a_benchmark_share_one_batch_size():
    """Honest copies probed at 16 and 26 ms draw K = 2 and 1 on CPU; both are timed at 2, so each
    pays the same crossing per call. A program too slow for the common K within the stretch keeps
    the most that fits; none goes below its own K or above the capacity."""
    per_call = {"reference": 0.016, "solution": 0.026}
    sizes = {name: batch_size(t, 256, "cpu") for name, t in per_call.items()}
    assert sizes == {"reference": 2, "solution": 1}
    assert common_sizes(sizes, per_call, 256, "cpu") == {"reference": 2, "solution": 2}
    fast, slow = 0.0001, 0.05  # 250 calls fill the target; the slow one may stretch to 8 x 25 ms
    sizes = {"fast": batch_size(fast, 256, "cpu"), "slow": batch_size(slow, 256, "cpu")}
    shared = common_sizes(sizes, {"fast": fast, "slow": slow}, 256, "cpu")
    assert shared == {"fast": 250, "slow": round(MAX_BATCH_STRETCH * BATCH_TARGET_S["cpu"] / slow)}
    assert common_sizes({"a": 3}, {}, 256, "cpu") == {"a": 3}  # a failed probe: its own K, not the capacity


def test_the_crossing_comes_off_each_batch_never_more_than_half():
    """A 1024-call batch of 10 µs calls with a 290 µs crossing reads 10 µs a call, not 10.28; a
    crossing measured too large (noise) takes at most half a batch."""
    assert net_seconds(1024 * 10e-6 + 290e-6, 290e-6) / 1024 == pytest.approx(10e-6)
    assert net_seconds(1e-3, 5e-3) == 0.5e-3
    assert net_seconds(1e-3, 0.0) == 1e-3


def test_the_stream_order_check_samples_every_output_within_its_bytes():
    from commweave.evaluate.runner import SAMPLES_PER_OUTPUT, sample_offsets

    offsets = sample_offsets(5, 1 << 20, 3 << 18, torch.device("cpu")).view(5, SAMPLES_PER_OUTPUT)
    begins = torch.arange(5).unsqueeze(1) * (1 << 20)
    assert bool(((offsets >= begins) & (offsets < begins + (3 << 18))).all())
    assert len(set(offsets[0].tolist())) > SAMPLES_PER_OUTPUT * 0.9  # spread over the output, not one spot
    small = sample_offsets(2, 256, 10, torch.device("cpu")).view(2, SAMPLES_PER_OUTPUT)
    assert set(small[0].tolist()) == set(range(10)) and set(small[1].tolist()) == set(range(256, 266))


def test_a_baseline_killed_while_the_host_ran_out_of_memory_is_no_tampering(monkeypatch):
    """PKB #78 on 2 CPU ranks: the kernel's OOM killer took a baseline's process (exit code 137)
    beside the candidate; /proc/vmstat's oom_kill rose during the benchmark, so: runtime_error."""
    import commweave.evaluate.evaluator as evaluator_module

    counts = iter([7, 8])
    monkeypatch.setattr(evaluator_module, "host_oom_kills", lambda: next(counts))
    died = Verdict.failed(FailureClass.RUNTIME_ERROR, "run(): rank 1's program process died (exit code 137)")
    shape = ToyGatherMatmul().make_shape(4, 4, 4)
    pool = _ScriptedPool(_passing_check(), _evaluate_job({"candidate": Verdict.passed(), "host": died}),
                         _bench_job({"host": Verdict.passed()}))
    result = Evaluator(pool, ToyGatherMatmul()).evaluate((PROGRAMS / "host.py").read_text(), shape)
    assert result.verdict.failure == FailureClass.RUNTIME_ERROR, result.verdict.message
    assert "out-of-memory killer" in result.verdict.message and not pool.results


def test_a_candidate_dying_while_the_host_ran_out_of_memory_says_so(monkeypatch):
    """PKB #76 on 2 CPU ranks and 24 GB: the kernel's OOM killer took the solution's process (exit
    code 137). Still the solution's failure, but its message names the host's memory, and a problem
    table files it under 'host out of memory', not a crash."""
    import commweave.evaluate.evaluator as evaluator_module
    from commweave.evaluate.jobs import RankEvaluation
    from commweave.problems.suite import cause_of

    counts = iter([3, 4])
    monkeypatch.setattr(evaluator_module, "host_oom_kills", lambda: next(counts))
    died = Verdict.failed(FailureClass.RUNTIME_ERROR, "run(): rank 0's program process died (exit code 137)")
    pool = _ScriptedPool(_passing_check(), JobResult("ok", [RankEvaluation(died, None), RankEvaluation(Verdict.passed(), None)],
                                                     [None, None], elapsed_s=1.0))
    result = Evaluator(pool, ToyGatherMatmul()).evaluate((PROGRAMS / "host.py").read_text(),
                                                          ToyGatherMatmul().make_shape(4, 4, 4))
    assert result.verdict.failure == FailureClass.RUNTIME_ERROR
    assert evaluator_module.HOST_OUT_OF_MEMORY in result.verdict.message, result.verdict.message
    assert cause_of(f"runtime_error: {result.verdict.message}") == "host out of memory"
    assert cause_of("wrong_result: output differs") == "wrong_result" and cause_of(None) == "ok"
