"""The LLM slow path on a CPU: real local servers speaking OpenAI's and Anthropic's protocols
replay scripted answers through the real SDKs, the simulated evaluator scores the programs (a
CONFIG edit in the text changes its fitness), and the run database records every call."""

from __future__ import annotations

import itertools
import json
import random
import sqlite3
import sys
import threading
import time

import pytest
from llm_servers import Fail, Raw, Reply, ScriptedAnthropicServer, ScriptedOpenAIServer, Stall, Trickle
from typer.testing import CliRunner

from commweave.cli import app
from commweave.evaluate.floor import MachineRates
from commweave.contracts.program import with_config
from commweave.search import Budget, Evolution, ProgramDB, SearchConfig
from commweave.search import prompts
from commweave.search.db import ProgramRecord
from commweave.search.llm_proposer import PHASES, LLMProposer, Malformed, PhasePolicy, Request
from commweave.search.simulate import SimulatedEvaluator
from commweave.space import DirectiveSet, program_body
from commweave.workloads import get_workload

TEMPLATE = get_workload("gemm-allgather").template()
SHAPE = TEMPLATE.default_shape(4)
SEED = TEMPLATE.seed_directives()
SEED_TEXT = TEMPLATE.render(SEED, SHAPE, 4)
SEED_BODY = program_body(SEED_TEXT)
OPTIMUM = SEED.with_(comm_ctas=16)  # the seed is one step away: fitness 1.7, the optimum 2.0
CTAS_LINE = next(line for line in SEED_BODY.splitlines(keepends=True) if line.strip().startswith("comm_ctas=8,"))
PRICES = dict(input_usd_per_mtok=10.0, output_usd_per_mtok=20.0)  # 100 in + 50 out tokens: $0.002 a call
CALL_USD = 0.002
#: for budget tests: 50 output tokens at most, prompts free, so a call's worst case is its real cost, $0.002
CAPPED = dict(input_usd_per_mtok=0.0, output_usd_per_mtok=40.0, max_tokens=50)
ONLY = {patch: {"explore": PhasePolicy({patch: 1.0}, 0.9), "exploit": PhasePolicy({patch: 1.0}, 0.2)}
        for patch in ("diff", "full", "crossover")}


def stated(ds: DirectiveSet) -> str:
    return "I target this set.\n```json\n" + json.dumps(ds.to_dict()) + "\n```\n"


def diff_answer(search: str, replace: str, ds: DirectiveSet = OPTIMUM) -> str:
    return stated(ds) + f"<<<<<<< SEARCH\n{search}=======\n{replace}>>>>>>> REPLACE\n"


def rewrite_answer(body: str, ds: DirectiveSet) -> str:
    return stated(ds) + f"```python\n{body}```\n"


def knobs_answer(comm_ctas: int, threads: int) -> str:
    """A full rewrite of the seed with two CONFIG values changed, stating that set."""
    return rewrite_answer(with_config(SEED_BODY, comm_ctas=comm_ctas, threads=threads),
                          SEED.with_(comm_ctas=comm_ctas, knobs=dict(threads=threads)))


GOOD_DIFF = diff_answer(CTAS_LINE, "    comm_ctas=16,\n")
GOOD_REWRITE = knobs_answer(16, 512)


def distinct_rewrites():
    """A script step answering each request with a program not seen before (thread-safe)."""
    combos = itertools.cycle([(c, t) for c in (16, 4, 2, 32, 1) for t in (512, 256, 128)])
    return lambda body: knobs_answer(*next(combos))


def search_with(tmp_path, srv, *, budget: int = 2, islands: int = 1, llm_islands: int = 1, patch: str = "diff",
                llm_budget: float | None = None, name: str = "run", model: dict | None = None, delay_s: float = 0.0,
                wall_s: float | None = None, **config) -> Evolution:
    """A search of `budget` evaluations (or `wall_s` seconds) whose LLM islands call `srv`."""
    ev = SimulatedEvaluator(TEMPLATE, 4, OPTIMUM, delay_s=delay_s)
    run_budget = Budget(seconds=wall_s) if wall_s is not None else Budget(evaluations=budget)
    search = Evolution(ProgramDB(tmp_path / f"{name}.sqlite"), TEMPLATE, ev, SHAPE, 4, run_budget,
                       SearchConfig(islands=islands, llm_islands=llm_islands, seed=1, **config),
                       llm_models=[srv.model(**(PRICES | (model or {})))], llm_budget_usd=llm_budget)
    search.llm.phases = ONLY[patch]
    return search


def costs_add_up(search: Evolution) -> None:
    rows = search.db.llm_calls()
    assert sum(r["cost"] for r in rows) == pytest.approx(search.ledger.spent_usd)
    assert search.db.meta()["llm_spent_usd"] == pytest.approx(search.ledger.spent_usd)
    for p in search.db.programs():
        if p.proposer == "scripted":
            assert p.cost == pytest.approx(sum(r["cost"] for r in rows if r["program_id"] == p.id and r["purpose"] == "propose"))


# -- the slow path end to end ------------------------------------------------------------------
@pytest.mark.parametrize("server_cls", [ScriptedOpenAIServer, ScriptedAnthropicServer], ids=["openai", "anthropic"])
def test_scripted_diff_raises_fitness(tmp_path, server_cls):
    with server_cls([Reply(GOOD_DIFF)]) as srv:
        search = search_with(tmp_path, srv)
        best = search.run()
        (request,) = srv.requests
    seed, child = search.db.programs()
    assert child.proposer == "scripted" and child.parents == [seed.id] and child.cost == pytest.approx(CALL_USD)
    assert child.fitness > seed.fitness and best.id == child.id
    assert child.directives == OPTIMUM.to_dict() and "comm_ctas=16," in child.code
    assert child.timings["how"] == "exploit: llm diff" and child.timings["llm_samples"] == 1
    (call,) = search.db.llm_calls()
    assert (call["outcome"], call["purpose"], call["program_id"], call["input_tokens"]) == ("ok", "propose", child.id, 100)
    prompt = srv.prompt(0)
    assert prompts.SYSTEM in prompt and SEED_BODY in prompt and "<<<<<<< SEARCH" in prompt
    if server_cls is ScriptedOpenAIServer:
        assert request["temperature"] == ONLY["diff"]["exploit"].temperature
    assert search.models.stats()["scripted"]["mean_reward"] > 0
    assert search.db.meta()["stop_reason"] == "the budget is spent"
    costs_add_up(search)


BAD_ANSWERS = {
    # kind: (patch type, the unusable answer, the answer after it)
    "no_match": ("diff", diff_answer("    comm_ctas=7,\n", "    comm_ctas=16,\n"), GOOD_DIFF),
    "outside_block": ("diff", diff_answer("import torch\n", "import torch as th\n"), GOOD_DIFF),
    "markers_removed": ("full", rewrite_answer(SEED_BODY.replace("# EVOLVE-BLOCK-END\n", ""), OPTIMUM), GOOD_REWRITE),
    "invalid_directives": ("diff", diff_answer(CTAS_LINE, "    comm_ctas=16,\n", OPTIMUM.with_(backend="ce")), GOOD_DIFF),
    "no_json": ("diff", f"<<<<<<< SEARCH\n{CTAS_LINE}=======\n    comm_ctas=16,\n>>>>>>> REPLACE\n", GOOD_DIFF),
    "bad_json": ("diff", "```json\n{backend: lsa}\n```\n", GOOD_DIFF),
    "syntax": ("diff", diff_answer(CTAS_LINE, "    comm_ctas=16,,\n"), GOOD_DIFF),
    "unchanged": ("diff", diff_answer(CTAS_LINE, CTAS_LINE), GOOD_DIFF),
    "no_code": ("full", stated(OPTIMUM) + "I would raise comm_ctas to 16.", GOOD_REWRITE),
}


@pytest.mark.parametrize("kind", list(BAD_ANSWERS))
def test_unusable_answer_is_resampled_with_its_error(tmp_path, kind):
    patch, bad, good = BAD_ANSWERS[kind]
    with ScriptedOpenAIServer([bad, good]) as srv:
        search = search_with(tmp_path, srv, patch=patch)
        search.run()
        assert len(srv.requests) == 2
        second = srv.requests[1]["messages"]
    (malformed,) = search.db.llm_calls(outcome=f"malformed:{kind}")
    assert malformed["message"] and malformed["cost"] == 0
    # the same conversation goes on: the bad answer, then the reason it could not be used
    assert second[-2] == {"role": "assistant", "content": bad}
    assert malformed["message"] in second[-1]["content"] and kind in second[-1]["content"]
    child = search.db.programs()[-1]
    assert child.proposer == "scripted" and child.timings["llm_samples"] == 2 and child.cost == pytest.approx(2 * CALL_USD)
    assert {r["id"] for r in search.db.llm_calls(program_id=child.id)} >= {malformed["id"]}
    costs_add_up(search)


def test_invalid_directives_message_names_every_reason(tmp_path):
    patch, bad, good = BAD_ANSWERS["invalid_directives"]
    with ScriptedOpenAIServer([bad, good]) as srv:
        search_with(tmp_path, srv).run()
        reason = srv.requests[1]["messages"][-1]["content"]
    assert "backend ce moves data with copy engines, no SMs: comm_ctas must be 0" in reason
    assert "issuer must be thread" in reason


@pytest.mark.parametrize("script, model, outcomes", [
    ([Stall(3.0), GOOD_DIFF], dict(max_retries=0, timeout_s=0.5), ["timeout", "ok"]),
    ([Fail(429, retry_after="0"), GOOD_DIFF], {}, ["rate_limited", "ok"]),
    ([Fail(500)] * 3 + [GOOD_DIFF], {}, ["server_error"] * 3 + ["ok"]),
], ids=["timeout", "429-then-ok", "500"])
def test_failed_calls_are_recorded_and_skipped(tmp_path, script, model, outcomes):
    with ScriptedOpenAIServer(script) as srv:
        search = search_with(tmp_path, srv, model=model)
        search.run()
        conversations = [len(r["messages"]) for r in srv.requests]
    assert [r["outcome"] for r in search.db.llm_calls()] == outcomes
    child = search.db.programs()[-1]
    assert child.proposer == "scripted" and child.fitness == pytest.approx(2.0)
    assert conversations == [2] * len(outcomes)  # system + prompt: a skipped proposal is asked afresh, not resampled
    linked = search.db.llm_calls(program_id=child.id)
    if outcomes[0] == "rate_limited":  # a retry inside one proposal: both attempts belong to the child
        assert [r["outcome"] for r in linked] == ["rate_limited", "ok"]
    else:  # the failed proposal was skipped; its rows stay unlinked
        assert [r["outcome"] for r in linked] == ["ok"]
    failed = [r for r in search.db.llm_calls() if r["outcome"] != "ok"]
    assert all(r["message"] for r in failed)
    costs_add_up(search)


def test_a_child_already_in_the_database_is_not_evaluated_again(tmp_path):
    worse = knobs_answer(4, 512)  # the seed stays the best, so the parent of the next proposal
    with ScriptedOpenAIServer([worse, worse, GOOD_REWRITE]) as srv:
        search = search_with(tmp_path, srv, budget=3, patch="full")
        search.run()
    programs = search.db.programs()
    assert len(programs) == 3 and len({program_body(p.code) for p in programs}) == 3
    (dup,) = search.db.llm_calls(outcome="duplicate")
    assert "already in the database" in dup["message"] and dup["program_id"] is None
    costs_add_up(search)


def test_llm_islands_need_models_and_models_need_islands(tmp_path):
    ev = SimulatedEvaluator(TEMPLATE, 4, OPTIMUM)
    with pytest.raises(ValueError, match="LLM islands need at least one model"):
        Evolution(ProgramDB(tmp_path / "a.sqlite"), TEMPLATE, ev, SHAPE, 4, Budget(evaluations=2),
                  SearchConfig(islands=2, llm_islands=1))
    with ScriptedOpenAIServer() as srv, pytest.raises(ValueError, match="llm_islands=3 must be between 0 and islands=2"):
        Evolution(ProgramDB(tmp_path / "b.sqlite"), TEMPLATE, ev, SHAPE, 4, Budget(evaluations=2),
                  SearchConfig(islands=2, llm_islands=3), llm_models=[srv.model()])


def test_an_island_that_gets_no_usable_child_rests_and_the_run_ends(tmp_path):
    bad = BAD_ANSWERS["no_match"][1]
    with ScriptedOpenAIServer([bad] * 9) as srv:
        search = search_with(tmp_path, srv, budget=20, llm_max_failures=3, llm_max_resamples=2)
        search.run()
        assert len(srv.requests) == 9 and srv.remaining == 0
    assert search.db.count() == 1  # the seed only
    assert len(search.db.llm_calls(outcome="malformed:no_match")) == 9 and len(search.db.llm_calls(outcome="ok")) == 9
    reason = search.db.meta()["stop_reason"]
    assert "3 proposals in a row without a usable child" in reason and "no_match" in reason
    costs_add_up(search)


def test_budget_stop_and_cost_accounting(tmp_path):
    with ScriptedOpenAIServer([distinct_rewrites()] * 40) as srv:
        search = search_with(tmp_path, srv, budget=30, islands=2, llm_islands=2, patch="full", llm_budget=0.005,
                             model=CAPPED)
        search.run()
        assert len(srv.requests) == 2  # a third call's worst case would pass the cap: never sent
    spent = search.ledger.spent_usd
    assert spent == pytest.approx(2 * CALL_USD) and spent <= 0.005
    assert search.db.count() < 30
    meta = search.db.meta()
    assert meta["llm_budget_usd"] == 0.005 and "LLM budget of $0.0050 is spent" in meta["stop_reason"]
    assert meta["llm_stopped"] in meta["stop_reason"]
    llm_programs = [p for p in search.db.programs() if p.proposer == "scripted"]
    assert llm_programs and sum(p.cost for p in llm_programs) <= spent + 1e-12
    costs_add_up(search)


def test_resume_keeps_the_spent_dollars(tmp_path):
    with ScriptedOpenAIServer([distinct_rewrites()] * 10) as srv:
        first = search_with(tmp_path, srv, budget=2, patch="full", llm_budget=0.005, model=CAPPED)
        first.run()
        assert first.db.meta()["llm_spent_usd"] == pytest.approx(CALL_USD)
        first.db.set_meta(budget={"evaluations": 20, "seconds": None})
        first.db.close()
        resumed = search_with(tmp_path, srv, budget=2, patch="full", llm_budget=None, model=CAPPED)
        assert resumed.ledger.spent_usd == pytest.approx(CALL_USD) and resumed.ledger.budget_usd == 0.005
        resumed.run()
        assert len(srv.requests) == 2  # $0.002 before, one more fits the $0.005 cap, a third would pass it
    assert resumed.ledger.spent_usd == pytest.approx(2 * CALL_USD)
    assert "LLM budget" in resumed.db.meta()["stop_reason"]
    assert [p.id for p in resumed.db.programs()] == [1, 2, 3]
    costs_add_up(resumed)


def test_llm_and_offline_islands_in_one_search(tmp_path):
    """The evaluator keeps working while the model writes: each answer is held back until the
    offline island has had 4 more programs evaluated (an evaluator waiting on the model would never
    get there). Once the offline island has good programs, crossover prompts combine one of them
    with the LLM island's parent."""
    rewrites = distinct_rewrites()
    held: dict = {}
    released_by_progress: list[bool] = []

    def after_four_evaluations(body):
        search, start = held["search"], held["search"].evaluated
        deadline = time.monotonic() + 4.0
        while search.evaluated < start + 4 and not search.exhausted() and time.monotonic() < deadline:
            time.sleep(0.002)
        released_by_progress.append(search.evaluated >= start + 4)
        return rewrites(body)

    with ScriptedOpenAIServer([after_four_evaluations] * 20) as srv:
        held["search"] = search = search_with(tmp_path, srv, budget=30, islands=2, llm_islands=1, patch="crossover",
                                              model=dict(timeout_s=5.0), delay_s=0.01, llm_meta_every=1000)
        search.run()
        texts = [srv.prompt(i) for i in range(len(srv.requests))]
    assert len(texts) >= 2 and all(released_by_progress[:-1])
    assert "Combine the parent" not in texts[0]  # only the seed exists: a full rewrite instead
    assert all("Combine the parent with program #" in t and "(to combine with the parent)" in t for t in texts[1:])
    programs = search.db.programs()
    assert len(programs) == 30
    by = {p.island: {q.proposer for q in programs if q.island == p.island} for p in programs}
    assert by[0] <= {"seed", "offline"} and by[1] == {"scripted"}
    assert min(p.id for p in programs if p.proposer == "scripted") >= 6  # seed + 4 offline programs first
    assert search.db.meta()["config"]["llm_islands"] == 1
    costs_add_up(search)


def test_meta_summary_reaches_later_prompts(tmp_path):
    rewrites = distinct_rewrites()
    summary = "- comm_ctas 16 made the push faster"

    def answer(body):
        last = body["messages"][-1]["content"]
        return summary if "Summarise in at most 10" in last else rewrites(body)

    with ScriptedOpenAIServer([answer] * 10) as srv:
        search = search_with(tmp_path, srv, budget=6, patch="full", llm_meta_every=2)
        search.run()
        texts = [srv.prompt(i) for i in range(len(srv.requests))]
    asked = [i for i, t in enumerate(texts) if "Summarise in at most 10" in t]
    assert asked and search.db.meta()["llm_meta_summary"] == summary
    assert f"## What worked so far\n{summary}" in texts[asked[0] + 1]
    assert "fitness" in texts[asked[0]] and "#1" in texts[asked[0]]  # the database's best programs
    assert {r["purpose"] for r in search.db.llm_calls()} == {"propose", "meta"}
    assert all(r["program_id"] is None for r in search.db.llm_calls() if r["purpose"] == "meta")
    costs_add_up(search)


def test_driver_shows_the_llm_spend(tmp_path):
    from io import StringIO

    from rich.console import Console
    from rich.progress import Progress

    from commweave.search.driver import evolve

    out = StringIO()
    def answer(body):  # the patch type is the search's random choice: answer in the form asked for
        return GOOD_DIFF if "SEARCH/REPLACE edits" in body["messages"][-1]["content"] else GOOD_REWRITE

    with ScriptedOpenAIServer([answer]) as srv, Progress(console=Console(file=out, width=150)) as progress:
        best, count, paused = evolve(tmp_path / "d.sqlite", TEMPLATE, SimulatedEvaluator(TEMPLATE, 4, OPTIMUM), SHAPE, 4,
                                     Budget(evaluations=2), SearchConfig(islands=1, llm_islands=1), progress=progress,
                                     llm_models=[srv.model(**PRICES)], llm_budget_usd=1.0, hardware={"GPU": "sim"})
        assert "- GPU: sim" in srv.prompt(0)
    assert count == 2 and best.proposer == "scripted" and not paused
    assert "LLM $0.00" in out.getvalue()


# -- a loop that survives its LLM ---------------------------------------------------------------
TRUNCATED = ('{"id": "chatcmpl-1", "choices": [{"index": 0, "message": {"role": "assistant", "content": '
             + json.dumps(GOOD_DIFF)[:120]).encode()
UNUSABLE_REPLIES = {
    # case: (the reply, the outcome of its llm_calls row, words of that row's message, model overrides)
    "truncated-json": (Raw(TRUNCATED), "bad_response", "truncated or malformed JSON", {}),
    "html": (Raw(b"<html><body><h1>502 Bad Gateway</h1></body></html>", content_type="text/html"), "bad_response",
             "an HTML page", {}),
    "not-json": (Raw(b"model overloaded, retry later", content_type="text/plain"), "bad_response", "is not JSON", {}),
    "5mb-body": (Reply(GOOD_DIFF + "#" * 5_000_000), "bad_response", "over max_reply_bytes=2097152", {}),
    "negative-usage": (Reply(GOOD_DIFF, input_tokens=-9_000_000_000, output_tokens=50), "bad_response",
                       "not a token count >= 0", {}),
    "trickle": (Trickle(GOOD_DIFF, interval_s=0.05), "timeout", "timeout_s=0.4 s", dict(max_retries=0, timeout_s=0.4)),
}


@pytest.mark.parametrize("case", list(UNUSABLE_REPLIES))
def test_an_unusable_reply_is_recorded_and_the_island_goes_on(tmp_path, case):
    """The reply ends its proposal with a recorded outcome and reason (charged its worst case: the
    server did the work); the island asks afresh and the run goes on to the next child."""
    reply, outcome, words, model = UNUSABLE_REPLIES[case]
    with ScriptedOpenAIServer([reply, GOOD_DIFF]) as srv:
        search = search_with(tmp_path, srv, model=model)
        search.run()
        assert len(srv.requests) == 2
    bad, ok = search.db.llm_calls()
    assert (bad["outcome"], ok["outcome"]) == (outcome, "ok") and words in bad["message"], bad["message"]
    assert "charged the worst case" in bad["message"] and bad["cost"] > CALL_USD and bad["program_id"] is None
    child = search.db.programs()[-1]
    assert child.proposer == "scripted" and child.fitness == pytest.approx(2.0)
    assert search.db.meta()["stop_reason"] == "the budget is spent"
    costs_add_up(search)


def test_a_reply_without_usage_makes_a_child_charged_its_worst_case(tmp_path):
    with ScriptedOpenAIServer([Reply(GOOD_DIFF, usage=False)]) as srv:
        search = search_with(tmp_path, srv, model=CAPPED)
        with pytest.warns(RuntimeWarning, match="no token usage"):
            search.run()
    (call,) = search.db.llm_calls()
    assert call["outcome"] == "ok" and "no token usage: charged its worst case" in call["message"]
    assert call["cost"] == pytest.approx(CALL_USD)  # CAPPED: the worst case is 50 tokens at $40 per million
    child = search.db.programs()[-1]
    assert child.cost == pytest.approx(CALL_USD) and child.fitness == pytest.approx(2.0)
    costs_add_up(search)


def test_a_program_over_its_cap_is_sent_back(tmp_path):
    cap = len(SEED_BODY.encode()) + 1000
    padded = rewrite_answer(with_config(SEED_BODY, comm_ctas=16).replace("# EVOLVE-BLOCK-END",
                                                                         "#" * 2000 + "\n# EVOLVE-BLOCK-END"), OPTIMUM)
    with ScriptedOpenAIServer([padded, GOOD_REWRITE]) as srv:
        search = search_with(tmp_path, srv, patch="full", model=dict(max_program_bytes=cap))
        search.run()
        echoed = srv.requests[1]["messages"][-2]["content"]
    (refused,) = search.db.llm_calls(outcome="malformed:too_large")
    assert f"over max_program_bytes={cap} (the model's config)" in refused["message"]
    assert len(echoed.encode()) < len(padded.encode()) and "more bytes of your answer not repeated" in echoed
    assert len(search.db.programs()[-1].code.encode()) <= cap


@pytest.mark.parametrize("cap, calls", [(0.003, 1), (0.007, 3)])
def test_eight_llm_islands_never_spend_past_the_cap(tmp_path, cap, calls):
    """$0.002 a call, 8 islands calling at once (each reply takes 0.5 s): as many calls go out
    together as the cap holds at their worst case, and the spend stays under the cap (with nothing
    reserved for calls in flight, a $0.003 cap let 8 islands spend $0.016)."""
    rewrites = distinct_rewrites()
    with ScriptedOpenAIServer([lambda body: Stall(0.5, rewrites(body))] * 40) as srv:
        search = search_with(tmp_path, srv, budget=30, islands=8, llm_islands=8, patch="full", llm_budget=cap,
                             model=CAPPED | dict(timeout_s=5))
        search.run()
        times = list(srv.times)
    rows = search.db.llm_calls()
    assert search.ledger.spent_usd <= cap and sum(r["cost"] for r in rows) <= cap
    assert len(times) == calls and max(times) - min(times) < 0.5  # in flight together
    assert [r["outcome"] for r in rows].count("ok") == calls and search.db.llm_calls(outcome="budget")
    assert f"LLM budget of ${cap:.4f}" in search.db.meta()["stop_reason"]
    costs_add_up(search)


@pytest.mark.parametrize("how", ["wall_budget", "stop_after_s"])
def test_a_run_with_a_short_wall_budget_returns_on_time(tmp_path, how):
    """A model trickling its reply (one byte per 50 ms, a 30 s call deadline) cannot hold the run:
    it returns within its 1 s of wall time plus the loop's 1 s wait, and the call in flight is
    abandoned and recorded."""
    with ScriptedOpenAIServer([Trickle(GOOD_DIFF, interval_s=0.05)] * 4) as srv:
        search = search_with(tmp_path, srv, model=dict(timeout_s=30), budget=100,
                             wall_s=1.0 if how == "wall_budget" else None)
        t0 = time.monotonic()
        search.run(stop_after_s=1.0 if how == "stop_after_s" else None)
        took = time.monotonic() - t0
    assert took < 1.0 + 1.5, took
    (call,) = search.db.llm_calls()
    assert call["outcome"] == "abandoned" and "the search run ended" in call["message"]
    assert search.ledger.reserved_usd == 0 and search.ledger.closed is not None
    costs_add_up(search)


# -- prompts, patch mix, parsing ----------------------------------------------------------------
def record(pid: int, ds: DirectiveSet, fitness: float, island: int = 0, failure: str | None = None,
           message: str = "", code: str | None = None) -> ProgramRecord:
    code = code or TEMPLATE.render(ds, SHAPE, 4)
    timings = {"candidate_us": 1000.0 / max(fitness, 1e-9), "baselines_us": {"host": 1000.0}, "floor_us": 400.0,
               "how": "explore: mutate 2"}
    return ProgramRecord(pid, code, "", ds.to_dict(), ds.key, [], island, 1, "failed" if failure else "ok",
                         fitness, failure, message, timings, "offline", 0.0, "")


def test_prompt_holds_every_section():
    rates = MachineRates(matmul_flops_per_s=123e12, link_bytes_per_s=45e9, hbm_bytes_per_s=3.5e12)
    proposer = LLMProposer(TEMPLATE, 4, SHAPE, rates=rates, hardware={"GPU": "NVIDIA H200", "NCCL": "2.28.9"})
    parent = record(1, SEED, 1.25)
    other = record(7, SEED.with_(comm_ctas=16, knobs=dict(threads=256)), 1.6, island=2)
    broken = record(9, SEED.with_(comm_ctas=32), 0.0, failure="timeout", message="watchdog: rank 2 hung in cw_ag_wait")
    request = Request(parent, "explore", "crossover", 0.9, (other,), (broken,), "- chunked sync helped", partner=other)
    text = proposer.prompt(request)
    for title in prompts.SECTIONS:
        assert f"\n## {title}\n" in "\n" + text, title
    assert "gemm-allgather" in text and str(SHAPE) in text and "GPUs (ranks): 4" in text and "`host`" in text
    assert "123.0 TFLOP/s" in text and "45.0 GB/s" in text and "measured on this machine" in text
    assert "- GPU: NVIDIA H200" in text and "physical floor" in text
    assert "copy engines: peer copies" in text and "fp8_e4m3" in text and "`threads` in 128, 256, 512" in text
    assert SEED_BODY in text and "fitness 1.25, median 800.0 µs, baseline host 1000.0 µs" in text
    assert "### Directives" in text and json.dumps(SEED.to_dict(), sort_keys=True) in text
    assert "Program #7" in text and "+    comm_ctas=16," in text  # the inspiration as a diff against the parent
    assert "watchdog: rank 2 hung in cw_ag_wait" in text and "- chunked sync helped" in text
    assert "Combine the parent with program #7" in text and other.code.splitlines()[-1] in text
    alone = proposer.prompt(Request(parent, "exploit", "diff", 0.2, (), (), ""))
    assert "## Inspirations\nNone yet." in alone and "## Recent failures\nNone yet." in alone
    assert "## What worked so far\nNo summary yet." in alone and "Combine the parent" not in alone
    unmeasured = LLMProposer(TEMPLATE, 4, SHAPE).prompt(request)
    assert "not measured in this run" in unmeasured and "Machine facts" not in unmeasured


def test_patch_mix_and_temperature_follow_the_phase():
    proposer = LLMProposer(TEMPLATE, 4, SHAPE)
    parent, other = record(1, SEED, 1.0), record(2, OPTIMUM, 1.5, island=1)
    rng = random.Random(0)
    mix = {phase: [proposer.request(parent, phase, rng, [other], []) for _ in range(400)] for phase in PHASES}
    share = {phase: sum(r.patch == "diff" for r in reqs) / len(reqs) for phase, reqs in mix.items()}
    assert share["exploit"] > share["explore"] + 0.25
    assert {r.patch for r in mix["explore"]} == {"diff", "full", "crossover"}
    assert mix["explore"][0].temperature > mix["exploit"][0].temperature
    assert all(r.partner is other for r in mix["explore"] if r.patch == "crossover")
    alone = [proposer.request(parent, "explore", rng, [], []) for _ in range(200)]
    assert {r.patch for r in alone} == {"diff", "full"}  # no second program: crossover becomes a full rewrite


def test_stated_directives_are_merged_with_the_parent_and_validated():
    proposer = LLMProposer(TEMPLATE, 4, SHAPE)
    parent = record(1, SEED, 1.0)
    ds = proposer.directives('```json\n{"comm_ctas": 16, "knobs": {"threads": 256}}\n```', parent)
    assert ds == SEED.with_(comm_ctas=16, knobs=dict(threads=256))
    # a strategy no template renders is fine if the space admits it
    assert proposer.directives('```json\n{"sync": "chunk", "chunk_bytes": 1048576, "placement": "fused"}\n```', parent).placement == "fused"
    for answer, needle in [('```json\n{"warp_size": 64}\n```', "unknown directive(s) warp_size"),
                           ('```json\n{"compression": "fp8_e4m3", "group_size": 128}\n```', "not admitted"),
                           ('```json\n{"backend": "gin"}\n```', "backend gin is not available"),
                           ('```json\n{"knobs": [1, 2]}\n```', "'knobs' must be an object")]:
        with pytest.raises(Malformed) as err:
            proposer.directives(answer, parent)
        assert err.value.kind == "invalid_directives" and needle in err.value.message


# -- database and CLI --------------------------------------------------------------------------
def test_an_old_database_opens_and_threads_record_calls(tmp_path):
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript("CREATE TABLE run (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
                       "INSERT INTO run VALUES ('workload', '\"gemm-allgather\"');")
    conn.close()
    with ProgramDB(path) as db:
        assert db.llm_calls() == [] and db.llm_spent() == 0.0 and db.meta()["workload"] == "gemm-allgather"

        def calls(n: int) -> None:
            for _ in range(n):
                db.add_llm_call(model="m", purpose="propose", outcome="ok", cost=0.001)

        threads = [threading.Thread(target=calls, args=(50,)) for _ in range(4)]
        for t in threads:
            t.start()
        for i in range(50):
            db.add_program(code=f"p{i}", directives=None, island=0, generation=i, status="ok", fitness=1.0)
        for t in threads:
            t.join()
        assert len(db.llm_calls()) == 200 and db.count() == 50
        assert db.meta()["llm_spent_usd"] == pytest.approx(0.2) == db.llm_spent()


runner = CliRunner()


def said(result) -> str:
    return " ".join(result.output.split())


@pytest.fixture
def no_llm_env(monkeypatch, tmp_path):
    for key in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_BASE_URL", "COMMWEAVE_LLM_CONFIG"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)  # no ./commweave-llm.toml


@pytest.mark.parametrize("args, message", [
    (["--llm", "nope"], "unknown LLM 'nope': configured models are none"),
    (["--llm", "openai:gpt-x"], "needs an API key: set OPENAI_API_KEY"),
    (["--llm", "openai:m@http://127.0.0.1:9/v1", "--llm-islands", "5"], "--llm-islands 5 must be between 1 and the 4"),
    (["--llm-budget", "3"], "--llm-config, --llm-budget and --llm-islands need --llm MODEL"),
    (["--llm", "mine", "--llm-config", "missing.toml"], "LLM config missing.toml is not a file"),
])
def test_evolve_llm_options_fail_clearly(no_llm_env, args, message):
    result = runner.invoke(app, ["evolve", "gemm-allgather", *args])
    assert result.exit_code == 2 and message in said(result), result.output


def test_evolve_llm_missing_sdk_names_the_extra(no_llm_env, monkeypatch):
    monkeypatch.setitem(sys.modules, "anthropic", None)
    result = runner.invoke(app, ["evolve", "gemm-allgather", "--llm", "anthropic:m@http://127.0.0.1:9"])
    assert result.exit_code == 2 and "pip install 'commweave[llm]'" in said(result)


def test_evolve_llm_resolves_configured_models_before_the_gpu_check(no_llm_env, tmp_path):
    (tmp_path / "models.toml").write_text('[models.mine]\nprovider = "openai"\nmodel = "m"\n'
                                          'base_url = "http://127.0.0.1:9/v1"\n')
    result = runner.invoke(app, ["evolve", "gemm-allgather", "--llm", "mine", "--llm-config", "models.toml",
                                 "--llm-budget", "2"])
    assert result.exit_code == 2 and "needs 1 CUDA GPU;" in said(result)
