"""Replies a client cannot use, and calls that must not outlive their deadline or pass the budget,
against real local servers through the real SDKs: every unusable reply is a recorded bad_response
naming why, a trickling reply is cut at the call's total deadline, a closed ledger abandons calls
in flight, and reservations keep concurrent calls under the cap."""

from __future__ import annotations

import json
import threading
import time
import warnings

import pytest
from llm_servers import Raw, Reply, ScriptedAnthropicServer, ScriptedOpenAIServer, Stall, Trickle

from commweave.llm import (Abandoned, BadResponse, BudgetExceeded, CallRecord, Ledger, LLMTimeout, Message,
                           ModelConfig, PromptTooLarge, client_for)
from commweave.llm.config import prompt_tokens_bound

HI = [Message("user", "hi")]
#: $20 per million output tokens and 100 at most: an attempt's worst case is $0.002 plus its prompt
PRICES = dict(input_usd_per_mtok=1.0, output_usd_per_mtok=20.0, max_tokens=100)


def worst_usd(config: ModelConfig, prompt: str = "hi", messages: int = 1) -> float:
    return config.cost_usd(prompt_tokens_bound(len(prompt.encode()), messages), config.max_tokens)


@pytest.fixture(params=[ScriptedOpenAIServer, ScriptedAnthropicServer], ids=["openai", "anthropic"])
def server_cls(request):
    return request.param


def _client(srv, ledger: Ledger | None = None, **overrides):
    records: list[CallRecord] = []
    ledger = ledger or Ledger()
    ledger.on_call = records.append
    config = srv.model(**(PRICES | overrides))
    return client_for(config, ledger), records


TRUNCATED = b'{"id": "chatcmpl-1", "choices": [{"index": 0, "message": {"role": "assistant", "content": "def run('
UNUSABLE = {
    "truncated": (Raw(TRUNCATED), "truncated or malformed JSON"),
    "html": (Raw(b"<!DOCTYPE html><html><body>502 Bad Gateway</body></html>", content_type="text/html"),
             "an HTML page, not JSON"),
    "not-json": (Raw(b"upstream said: try later", content_type="text/plain"), "is not JSON"),
    "json-array": (Raw(b"[1, 2, 3]"), "JSON but not an object"),
    "no-answer": (Raw(b'{"id": "x", "object": "nothing"}'), "the reply has no"),
    "negative-usage": (Reply("an answer", input_tokens=-9_000_000_000, output_tokens=50), "not a token count >= 0"),
    "fractional-usage": (Reply("an answer", input_tokens=10, output_tokens=2.5), "not a token count >= 0"),
    "output-over-max": (Reply("an answer", input_tokens=10, output_tokens=101), "over the max_tokens=100"),
    "huge-declared": (Reply("x" * 5_000_000), "over max_reply_bytes=2097152"),
    "huge-streamed": (Raw(b'{"choices": "' + b"x" * 3_000_000 + b'"}', declare_length=False),
                      "passed max_reply_bytes=2097152"),
}


@pytest.mark.parametrize("case", list(UNUSABLE))
def test_unusable_reply_is_a_recorded_bad_response(server_cls, case):
    """Not retried, charged its worst case (the server did the work), the reason in the record."""
    step, reason = UNUSABLE[case]
    with server_cls([step, Reply("unused")]) as srv:
        client, records = _client(srv, max_retries=3)
        with pytest.raises(BadResponse, match="scripted: ") as err:
            client.complete(HI)
        assert len(srv.requests) == 1 and srv.remaining == 1
    (rec,) = records
    assert rec.outcome == "bad_response" and reason in rec.message, rec.message
    assert rec.cost_usd == pytest.approx(worst_usd(client.config)) == client.ledger.spent_usd
    assert err.value.records == (rec,) and err.value.cost_usd == rec.cost_usd
    assert client.ledger.reserved_usd == 0


def test_a_reply_without_usage_is_charged_its_worst_case_and_warned_once(server_cls):
    with server_cls([Reply("first", usage=False), Reply("second", usage=False), Reply("third", 10, 5)]) as srv:
        client, records = _client(srv)
        with pytest.warns(RuntimeWarning, match="no token usage") as warned:
            first = client.complete(HI)
            second = client.complete(HI)
            third = client.complete(HI)
    assert len(warned) == 1
    assert (first.text, second.text) == ("first", "second") and [r.outcome for r in records] == ["ok"] * 3
    worst = worst_usd(client.config)
    assert first.cost_usd == second.cost_usd == pytest.approx(worst) and worst > 0.002
    assert "no token usage: charged its worst case" in records[0].message
    assert third.cost_usd == pytest.approx(client.config.cost_usd(10, 5))
    assert client.ledger.spent_usd == pytest.approx(2 * worst + third.cost_usd)


def test_negative_usage_cannot_lift_the_cap(server_cls):
    with server_cls([Reply("a", input_tokens=-9_000_000_000, output_tokens=-1), Reply("b", 10, 100),
                     Reply("never")]) as srv:
        client, records = _client(srv, ledger=Ledger(budget_usd=0.0045))
        with pytest.raises(BadResponse, match="not a token count"):
            client.complete(HI)
        client.complete(HI)
        with pytest.raises(BudgetExceeded):
            client.complete(HI)
        assert len(srv.requests) == 2
    assert [r.outcome for r in records] == ["bad_response", "ok", "budget"]
    assert 0 < client.ledger.spent_usd <= 0.0045


def test_a_trickling_reply_is_cut_at_the_total_deadline(server_cls):
    """One byte every 50 ms would take ~15 s; the call ends at its 0.4 s deadline, is booked once
    (a timeout, charged its worst case), and the abandoned worker stops reading soon after."""
    with server_cls([Trickle("x" * 100, interval_s=0.05)]) as srv:
        client, records = _client(srv, timeout_s=0.4, max_retries=0)
        before = set(threading.enumerate())
        t0 = time.monotonic()
        with pytest.raises(LLMTimeout, match=r"timeout_s=0.4 s \(connect and every read together\)"):
            client.complete(HI)
        took = time.monotonic() - t0
        time.sleep(0.3)  # the worker sees the abandonment at its next byte
        workers = [t for t in set(threading.enumerate()) - before if t.name.startswith("cw-llm-call")]
    assert 0.35 < took < 1.2, took
    assert not workers
    (rec,) = records
    assert rec.outcome == "timeout" and rec.cost_usd == pytest.approx(worst_usd(client.config))
    assert client.ledger.spent_usd == pytest.approx(rec.cost_usd) and client.ledger.reserved_usd == 0


def test_a_timed_out_attempt_is_retried_and_booked_once(server_cls):
    with server_cls([Stall(1.2, text="late"), Reply("on time", 10, 5)]) as srv:
        client, records = _client(srv, timeout_s=0.5, max_retries=1)
        done = client.complete(HI)
        time.sleep(0.9)  # the stalled reply arrives at the abandoned worker: it must not be booked
    assert done.text == "on time" and done.attempts == 2
    assert [r.outcome for r in records] == ["timeout", "ok"]
    assert done.cost_usd == pytest.approx(sum(r.cost_usd for r in records)) == client.ledger.spent_usd
    assert done.records == tuple(records)


def test_closing_the_ledger_abandons_calls_in_flight_and_refuses_new_ones():
    with ScriptedOpenAIServer([Stall(5.0), Stall(5.0)]) as srv:
        ledger = Ledger(budget_usd=1.0)
        client, records = _client(srv, ledger=ledger, timeout_s=10, max_retries=0)
        errors: list[BaseException] = []

        def call() -> None:
            try:
                client.complete(HI)
            except BaseException as e:  # the test asserts on it
                errors.append(e)

        threads = [threading.Thread(target=call) for _ in range(2)]
        for t in threads:
            t.start()
        while len(srv.requests) < 2:
            time.sleep(0.01)
        assert ledger.reserved_usd == pytest.approx(2 * worst_usd(client.config))
        t0 = time.monotonic()
        assert ledger.close("the run's wall time ended") == 2
        for t in threads:
            t.join(2.0)
        took = time.monotonic() - t0
        with pytest.raises(Abandoned, match="wall time ended"):
            client.complete(HI)
        assert len(srv.requests) == 2
        ledger.reopen()
        srv.add(Reply("after reopening", 10, 5))
        assert client.complete(HI).text == "after reopening"
    assert took < 0.5 and all(isinstance(e, Abandoned) for e in errors) and len(errors) == 2
    assert [r.outcome for r in records] == ["abandoned", "abandoned", "ok"]
    assert "wall time ended" in records[0].message and ledger.reserved_usd == 0


def test_concurrent_calls_never_pass_the_cap():
    """8 threads at once, each call costing $0.002 of a $0.003 cap: reservations let one through
    at a time while it fits, so the spend stays under the cap (without them it would be $0.016)."""
    with ScriptedOpenAIServer([Stall(0.2, text="slow")] * 8 + [Reply("x", 0, 100)] * 8) as srv:
        client, records = _client(srv, ledger=Ledger(budget_usd=0.003), input_usd_per_mtok=0.0, timeout_s=5)
        barrier = threading.Barrier(8)

        def call() -> None:
            barrier.wait()
            try:
                client.complete(HI)
            except BudgetExceeded:
                pass

        threads = [threading.Thread(target=call) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(5.0)
    assert len(srv.requests) == 1
    assert client.ledger.spent_usd <= 0.003 and client.ledger.reserved_usd == 0
    assert sorted(r.outcome for r in records) == ["budget"] * 7 + ["ok"]


def test_a_prompt_over_its_cap_is_not_sent(server_cls):
    with server_cls([Reply("unused")]) as srv:
        client, records = _client(srv, max_prompt_bytes=1000)
        with pytest.raises(PromptTooLarge, match=r"the prompt is 1008 bytes, over max_prompt_bytes=1000"):
            client.complete([Message("user", "x" * 1000)], system="be brief")
        assert srv.requests == []
    assert [r.outcome for r in records] == ["prompt_too_large"] and records[0].cost_usd == 0


def test_the_reply_cap_is_configurable():
    with ScriptedOpenAIServer([Reply("y" * 600), Reply("z" * 100)]) as srv:
        client, records = _client(srv, max_reply_bytes=500)
        with pytest.raises(BadResponse, match=r"over max_reply_bytes=500 \(raise it in the model's config\)"):
            client.complete(HI)
        assert client.complete(HI).text == "z" * 100 and len(json.dumps(srv.requests[0])) < 500


@pytest.mark.parametrize("key", ["max_reply_bytes", "max_program_bytes", "max_prompt_bytes"])
def test_caps_must_be_positive(key):
    with pytest.raises(ValueError, match=f"model 'm': {key} must be > 0, got 0"):
        ModelConfig(name="m", provider="openai", model="x", **{key: 0})


def test_ledger_reservations_settle_once():
    ledger = Ledger(budget_usd=1.0)
    held = ledger.reserve(0.6)
    assert ledger.remaining() == pytest.approx(0.4) and not ledger.exhausted
    with pytest.raises(BudgetExceeded, match=r"cannot hold this call's worst case of \$0.5000 .*\$0.6000 held"):
        ledger.reserve(0.5)
    assert ledger.exhausted  # until a call in flight settles below its worst case
    rec = CallRecord("m", "propose", "ok", 1, 1, 0.2, 0.1, "")
    assert ledger.settle(held, rec) and not ledger.settle(held, rec)
    assert ledger.spent_usd == pytest.approx(0.2) and ledger.reserved_usd == 0 and not ledger.exhausted
    with pytest.raises(ValueError, match="reservation must be >= 0"):
        ledger.reserve(-1.0)
    with pytest.raises(ValueError, match="needs a reason"):
        ledger.close("")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Ledger().reserve(5.0).usd == 5.0  # no cap: anything fits
