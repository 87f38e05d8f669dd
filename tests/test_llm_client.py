"""The LLM clients against real local HTTP servers through the real SDKs: answers, token and cost
accounting, retries (429 with Retry-After, 5xx, timeouts), 4xx without retry, the budget stop,
keys and base URLs."""

from __future__ import annotations

import datetime
import email.utils
import sys

import pytest
from llm_servers import Fail, Reply, ScriptedAnthropicServer, ScriptedOpenAIServer, Stall

from commweave.llm import (BadResponse, BudgetExceeded, CallRecord, Ledger, LLMTimeout, Message, ModelConfig,
                           RateLimited, ServerError, client_for, resolve_model)
from commweave.llm.client import LOCAL_PLACEHOLDER_KEY, MAX_RETRY_AFTER_S, OpenAIChatClient, _retry_after_s

HI = [Message("user", "hi")]


@pytest.fixture(params=[ScriptedOpenAIServer, ScriptedAnthropicServer], ids=["openai", "anthropic"])
def server_cls(request):
    return request.param


def _client(srv, ledger: Ledger | None = None, **overrides):
    """A client for `srv` whose ledger's records land in the list returned with it."""
    return _client_for(srv.model(**overrides), ledger)


def _client_for(config: ModelConfig, ledger: Ledger | None = None):
    records: list[CallRecord] = []
    ledger = ledger or Ledger()
    ledger.on_call = records.append
    return client_for(config, ledger), records


def test_answer_tokens_and_cost(server_cls):
    with server_cls([Reply("the answer", input_tokens=1000, output_tokens=500)]) as srv:
        client, records = _client(srv, input_usd_per_mtok=2.0, output_usd_per_mtok=8.0)
        done = client.complete([Message("user", "the question")], system="you are terse", purpose="judge")
        (body,) = srv.requests
    assert done.text == "the answer" and done.model == "scripted" and done.attempts == 1
    assert (done.input_tokens, done.output_tokens) == (1000, 500)
    assert done.cost_usd == pytest.approx((1000 * 2.0 + 500 * 8.0) / 1e6)
    assert client.ledger.spent_usd == pytest.approx(done.cost_usd)
    (rec,) = records
    assert (rec.model, rec.purpose, rec.outcome, rec.input_tokens, rec.output_tokens, rec.message) == (
        "scripted", "judge", "ok", 1000, 500, "")
    assert rec.cost_usd == pytest.approx(done.cost_usd)
    assert body["model"] == "scripted-model" and body["max_tokens"] == 8192
    if server_cls is ScriptedOpenAIServer:
        assert body["messages"] == [{"role": "system", "content": "you are terse"},
                                    {"role": "user", "content": "the question"}]
        assert body["temperature"] == 0.7
    else:  # the system prompt is its own field; no sampling parameters in API version 2026-10-21
        assert body["system"] == "you are terse"
        assert body["messages"] == [{"role": "user", "content": "the question"}]
        assert "temperature" not in body


def test_rate_limited_then_ok(server_cls):
    with server_cls([Fail(429, retry_after="0.2"), Reply("fine", 10, 5)]) as srv:
        client, records = _client(srv, backoff_s=0.001)
        done = client.complete(HI)
        wait = srv.times[1] - srv.times[0]
    assert done.text == "fine" and done.attempts == 2
    assert [r.outcome for r in records] == ["rate_limited", "ok"]
    assert "429" in records[0].message and records[0].cost_usd == 0
    assert wait >= 0.2  # Retry-After honoured, not the 1 ms backoff


def test_retry_after_forms_and_cap():
    future = email.utils.format_datetime(datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=30))
    assert _retry_after_s({"retry-after-ms": "150", "retry-after": "9"}) == pytest.approx(0.15)
    assert _retry_after_s({"retry-after": "2"}) == 2.0
    assert 25 < _retry_after_s({"retry-after": future}) <= 30
    assert _retry_after_s({"retry-after": "soon"}) is None and _retry_after_s({}) is None
    with ScriptedOpenAIServer() as srv:
        client = client_for(srv.model())
    assert client._wait_s(0, RateLimited("429", retry_after_s=3600)) == MAX_RETRY_AFTER_S
    assert 0.02 <= client._wait_s(2, ServerError("500")) <= 0.06  # 0.01 s doubled twice, jitter x0.5..1.5


def test_server_errors_exhaust_retries(server_cls):
    with server_cls([Fail(500), Fail(503), Fail(500), Reply("never")]) as srv:
        client, records = _client(srv, max_retries=2)
        with pytest.raises(ServerError, match="HTTP 500") as err:
            client.complete(HI)
        assert srv.remaining == 1
    assert err.value.kind == "server_error"
    assert [r.outcome for r in records] == ["server_error"] * 3


def test_timeout(server_cls):
    with server_cls([Stall(2.0), Reply("after one timeout"), Stall(2.0)]) as srv:
        client, records = _client(srv, max_retries=1, timeout_s=0.5)
        assert client.complete(HI).attempts == 2
        client = client_for(srv.model(max_retries=0, timeout_s=0.5), client.ledger)
        with pytest.raises(LLMTimeout):
            client.complete(HI)
    assert [r.outcome for r in records] == ["timeout", "ok", "timeout"]
    assert all(0.45 < r.latency_s < 1.5 for r in records if r.outcome == "timeout")


def test_client_error_is_not_retried(server_cls):
    with server_cls([Fail(400, message="unknown parameter foo"), Reply("unused")]) as srv:
        client, records = _client(srv, max_retries=3)
        with pytest.raises(BadResponse, match="unknown parameter foo"):
            client.complete(HI)
        assert len(srv.requests) == 1 and srv.remaining == 1
    assert [r.outcome for r in records] == ["bad_response"]


def test_empty_answer_is_bad_and_billed(server_cls):
    with server_cls([Reply("  \n", input_tokens=300, output_tokens=0)]) as srv:
        client, records = _client(srv, input_usd_per_mtok=10.0)
        with pytest.raises(BadResponse, match="no text"):
            client.complete(HI)
    assert [r.outcome for r in records] == ["bad_response"]
    assert records[0].cost_usd == pytest.approx(300 * 10.0 / 1e6) == client.ledger.spent_usd


def test_budget_stops_before_sending(server_cls):
    with server_cls([Reply("costly", input_tokens=1_000_000, output_tokens=0), Reply("unused")]) as srv:
        client, records = _client(srv, input_usd_per_mtok=3.0, ledger=Ledger(budget_usd=2.0))
        client.complete(HI)  # allowed: the budget was not spent before it
        assert client.ledger.exhausted and client.ledger.remaining() == 0
        with pytest.raises(BudgetExceeded, match="budget"):
            client.complete(HI)
        assert len(srv.requests) == 1
    assert [r.outcome for r in records] == ["ok", "budget"]
    assert records[1].cost_usd == 0 and client.ledger.spent_usd == pytest.approx(3.0)


def test_budget_spent_by_an_earlier_invocation_sends_nothing():
    with ScriptedOpenAIServer(["unused"]) as srv:
        client, records = _client(srv, ledger=Ledger(budget_usd=1.0, spent_usd=1.0))
        with pytest.raises(BudgetExceeded):
            client.complete(HI)
        assert srv.requests == []
    assert [r.outcome for r in records] == ["budget"]


def test_model_temperature_overrides_the_callers():
    with ScriptedOpenAIServer(["a"]) as srv:
        client, _ = _client(srv, temperature=1.0)
        client.complete(HI, temperature=0.2, max_tokens=77)
        assert srv.requests[0]["temperature"] == 1.0 and srv.requests[0]["max_tokens"] == 77


def test_keys_and_base_urls(server_cls, monkeypatch):
    with server_cls(["keyed", "keyless", "from env"]) as srv:
        monkeypatch.setenv("MY_LLM_KEY", "sk-test-123")
        client_for(srv.model(api_key_env="MY_LLM_KEY")).complete(HI)
        assert any("sk-test-123" in v for v in srv.headers[0].values())
        key_env = "OPENAI_API_KEY" if server_cls is ScriptedOpenAIServer else "ANTHROPIC_API_KEY"
        monkeypatch.delenv(key_env, raising=False)
        client_for(srv.model()).complete(HI)  # a local server: no key needed
        assert any(LOCAL_PLACEHOLDER_KEY in v for v in srv.headers[1].values())
        base_env = "OPENAI_BASE_URL" if server_cls is ScriptedOpenAIServer else "ANTHROPIC_BASE_URL"
        monkeypatch.setenv(base_env, srv.base_url)
        config = resolve_model(f"{srv.provider}:served-model", {})
        assert config.base_url is None
        assert client_for(config).complete(HI).text == "from env"
        assert srv.requests[2]["model"] == "served-model"
        monkeypatch.delenv(base_env)
        with pytest.raises(ValueError, match=key_env):  # a cloud model without a key
            client_for(config)


def test_official_openai_api_gets_max_completion_tokens(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-x")
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    official = OpenAIChatClient(ModelConfig(name="gpt", provider="openai", model="gpt-5"))
    local = OpenAIChatClient(ModelConfig(name="l", provider="openai", model="m", base_url="http://127.0.0.1:1/v1"))
    assert (official._max_tokens_param, local._max_tokens_param) == ("max_completion_tokens", "max_tokens")


def test_missing_sdk_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "openai", None)
    with pytest.raises(ImportError, match=r"commweave\[llm\]"):
        client_for(ModelConfig(name="l", provider="openai", model="m", base_url="http://127.0.0.1:1/v1"))


def test_connection_refused_is_a_server_error():
    with ScriptedOpenAIServer() as srv:
        config = srv.model(max_retries=1)
    client, records = _client_for(config)  # the server is gone: its port refuses connections
    with pytest.raises(ServerError, match="connection"):
        client.complete(HI)
    assert [r.outcome for r in records] == ["server_error", "server_error"]


def test_messages_are_checked():
    with pytest.raises(ValueError, match="system="):
        Message("system", "be brief")
    with ScriptedOpenAIServer() as srv:
        with pytest.raises(ValueError, match="at least one message"):
            client_for(srv.model()).complete([])


def test_ledger():
    seen: list[CallRecord] = []
    ledger = Ledger(budget_usd=1.0, on_call=seen.append, spent_usd=0.25)
    assert ledger.remaining() == 0.75 and not ledger.exhausted
    ledger.check()
    rec = CallRecord("m", "propose", "ok", 1, 1, 0.75, 0.1, "")
    ledger.record(rec)
    assert seen == [rec] and ledger.exhausted and ledger.remaining() == 0
    with pytest.raises(BudgetExceeded):
        ledger.check()
    assert Ledger().remaining() is None and not Ledger().exhausted
    with pytest.raises(ValueError, match="outcome"):
        CallRecord("m", "propose", "great", 0, 0, 0, 0, "")
    with pytest.raises(ValueError, match="budget"):
        Ledger(budget_usd=-1)
