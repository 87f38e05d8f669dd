"""attention-cp through the real evaluation cascade on a 2-rank CPU pool (gloo): the host
baselines pass the poisoned, fresh-seed checks; a ring that forgets a block is a wrong result;
an evaluation times the candidate beside the baselines and reports torch's CP as unavailable."""

from __future__ import annotations

import pytest

from commweave.evaluate import Evaluator, FailureClass
from commweave.runtime import WorkerPool
from commweave.workloads.attention_cp.workload import AttentionCP

WL = AttentionCP()


@pytest.fixture(scope="module")
def evaluator():
    with WorkerPool(2, device="cpu", job_timeout_s=120) as pool:
        yield Evaluator(pool, WL, seeds=2, warmup=1, iters=3)


def test_host_baselines_pass_the_checks(evaluator: Evaluator) -> None:
    for name in ("host", "allgather"):
        verdict = evaluator.check(WL.program_text(name))
        assert verdict.ok, f"{name}: {verdict.failure}: {verdict.message}"


def test_a_ring_that_drops_its_last_block_is_wrong(evaluator: Evaluator) -> None:
    text = WL.program_text("host")
    broken = text.replace("        _attend(ctx, state, inputs[\"q\"], cur, src)\n",
                          "        if step < world - 1:\n            _attend(ctx, state, inputs[\"q\"], cur, src)\n")
    assert broken != text
    verdict = evaluator.check(broken)
    assert not verdict.ok and verdict.failure == FailureClass.WRONG_RESULT, verdict.message


def test_evaluate_times_the_candidate_beside_the_baselines(evaluator: Evaluator) -> None:
    shape = WL.parse_shape("s256-q4kv2-d32-causal", 2)
    result = evaluator.evaluate(WL.program_text("allgather"), shape)
    assert result.verdict.ok, result.verdict.message
    assert result.fitness > 0 and result.baseline == "host"
    assert result.baselines["host"].verdict.ok and result.baselines["allgather"].verdict.ok
    assert result.baselines["torch_cp"].verdict.failure == FailureClass.UNAVAILABLE
    assert 0 < result.floor_us < result.candidate.median_us


@pytest.mark.parametrize("causal", [False, True])
def test_the_ideal_yardstick_is_timed_and_is_not_a_correct_program(evaluator: Evaluator, causal: bool) -> None:
    """The SDPA ideal (all-gather's compute without its all-gather) runs, gets times beside a real
    program, and its output is wrong: it must never pass for a program. (The seed's ideal needs GPUs.)"""
    assert "communicate=False" in WL.yardstick_text("ideal") and "communicate=True" in WL.program_text("seed")
    text = WL.yardstick_text("ideal_sdpa")
    assert "communicate=False" in text and "communicate=True" in WL.program_text("allgather")
    shape = WL.parse_shape(f"s256-q4kv2-d32-{'causal' if causal else 'full'}", 2)
    bench = evaluator.benchmark({"allgather": WL.program_text("allgather"), "ideal": text}, shape)
    assert bench.programs["allgather"].verdict.ok
    ideal = bench.programs["ideal"]
    assert ideal.median_us > 0 and ideal.verdict.failure == FailureClass.WRONG_RESULT, ideal.verdict
    with pytest.raises(KeyError, match="no yardstick 'fastest'"):
        WL.yardstick_text("fastest")
