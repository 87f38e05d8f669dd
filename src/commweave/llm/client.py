"""Chat completions from any OpenAI-compatible server (OpenAI, vLLM, SGLang, llama.cpp, Ollama, ...)
or Anthropic's messages API, through the official SDKs (the optional extra `commweave[llm]`).

The SDKs' own retries are off: our loop retries instead (429 honouring Retry-After, 5xx, timeouts,
lost connections; exponential backoff with jitter), so that every attempt becomes a CallRecord in
the run's ledger and holds a reservation of its worst-case cost while in flight.

Each attempt runs on a worker thread and is given up at its deadline (`timeout_s` for connect
and every read together), or at once when the ledger is closed: a server that trickles its reply
cannot hold a caller. The worker reads the body itself, in chunks, up to `max_reply_bytes`, and
the JSON is checked here, so any unusable reply (truncated, HTML, too large, bad usage) becomes a
BadResponse naming why. Only the caller's thread books an attempt, once.
"""

from __future__ import annotations

import email.utils
import json
import os
import random
import threading
import time
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from commweave.llm.config import DEFAULT_BASE_URL_ENV, DEFAULT_KEY_ENV, ModelConfig
from commweave.llm.ledger import (Abandoned, BadResponse, BudgetExceeded, CallRecord, LLMError, LLMTimeout, Ledger,
                                  PromptTooLarge, RateLimited, Reservation, ServerError)

ROLES = ("user", "assistant")
MAX_RETRY_AFTER_S = 60.0  # a server asking for longer is not waited for longer than this
MAX_BACKOFF_S = 60.0
LOCAL_PLACEHOLDER_KEY = "not-needed"  # local servers ignore the key, the SDKs insist on one
POLL_S = 0.02  # how often a caller waiting on its worker looks at the deadline and the ledger
_ERROR_TEXT_CHARS = 500
_HEAD_CHARS = 80  # of an unusable body, quoted in the error


@dataclass(frozen=True)
class Message:
    """One turn; role "user" or "assistant" (the system prompt is passed separately)."""

    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"message role {self.role!r} is not one of {ROLES} (pass the system prompt as system=)")


@dataclass(frozen=True)
class Completion:
    text: str
    model: str  # ModelConfig.name
    input_tokens: int  # the answering attempt's usage (0 when the reply stated none)
    output_tokens: int
    cost_usd: float  # every attempt of the call (a timed-out attempt may be billed)
    latency_s: float  # from the call to the answer, retries and backoff included
    attempts: int  # HTTP attempts this completion took (1 = no retry)
    records: tuple[CallRecord, ...] = ()  # one per attempt, as the ledger booked them


@dataclass(frozen=True)
class _Reply:
    """What one HTTP exchange returned, checked for shape; usage None when the reply stated none."""

    text: str
    input_tokens: int | None
    output_tokens: int | None
    finish_reason: str


class _Unusable(BadResponse):
    """A 200 reply that cannot be used; the server did the work, so it is charged its worst case."""


class LLMClient(ABC):
    """One configured model; `complete` sends a conversation and retries transient failures."""

    def __init__(self, config: ModelConfig, ledger: Ledger | None = None):
        self.config = config
        self.name = config.name
        self.ledger = ledger if ledger is not None else Ledger()
        self._rng = random.Random()  # backoff jitter only
        self._warned_usage = False

    def complete(self, messages: list[Message], *, system: str = "", temperature: float = 0.7,
                 max_tokens: int | None = None, purpose: str = "propose") -> Completion:
        """The model's answer. Raises PromptTooLarge or BudgetExceeded before sending (the prompt
        is over `max_prompt_bytes`; the budget cannot hold the attempt's worst case), Abandoned
        once the ledger is closed, BadResponse at once for a 4xx other than 429 or an unusable
        reply, and the error of the last attempt once `max_retries` retries of 429 / 5xx /
        timeouts are used up. Every error carries the records of the call's attempts."""
        if not messages:
            raise ValueError("complete() needs at least one message")
        if self.config.temperature is not None:
            temperature = self.config.temperature
        if max_tokens is None:
            max_tokens = self.config.max_tokens
        records: list[CallRecord] = []
        prompt_bytes = len(system.encode()) + sum(len(m.content.encode()) for m in messages)
        if prompt_bytes > self.config.max_prompt_bytes:
            error: LLMError = PromptTooLarge(
                f"{self.name}: the prompt is {prompt_bytes} bytes, over max_prompt_bytes={self.config.max_prompt_bytes} "
                "(raise it in the model's config); not sent")
            self._book(records, None, purpose, error.kind, 0, 0, 0.0, 0.0, error.message)
            raise self._failed(error, records)
        worst = self.config.worst_case_usd(prompt_bytes, len(messages) + bool(system), max_tokens)
        start = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                reservation = self.ledger.reserve(worst)
            except BudgetExceeded as e:
                self._book(records, None, purpose, e.kind, 0, 0, 0.0, 0.0, e.message)
                raise self._failed(e, records)
            except Abandoned as e:  # the run ended between attempts: nothing was sent
                raise self._failed(e, records)
            t0 = time.monotonic()
            try:
                reply = self._attempt(reservation, messages, system, temperature, max_tokens)
            except (RateLimited, ServerError) as e:  # refused or never reached: not billed
                self._book(records, reservation, purpose, e.kind, 0, 0, 0.0, time.monotonic() - t0, e.message)
                if attempt > self.config.max_retries:
                    raise self._failed(e, records)
                self.ledger.sleep(self._wait_s(attempt - 1, e))
                continue
            except (LLMTimeout, Abandoned, _Unusable) as e:  # sent, maybe answered: billable up to its worst case
                self._book(records, reservation, purpose, e.kind, 0, 0, worst, time.monotonic() - t0,
                           f"{e.message} (charged the worst case, ${worst:.6f}: the server may bill the reply)")
                if not isinstance(e, LLMTimeout) or attempt > self.config.max_retries:
                    raise self._failed(e, records)
                self.ledger.sleep(self._wait_s(attempt - 1, e))
                continue
            except LLMError as e:  # a 4xx: refused, not billed
                self._book(records, reservation, purpose, e.kind, 0, 0, 0.0, time.monotonic() - t0, e.message)
                raise self._failed(e, records)
            latency = time.monotonic() - t0
            if reply.input_tokens is None or reply.output_tokens is None:
                inp, out, cost = 0, 0, worst
                note = f"the reply states no token usage: charged its worst case, ${worst:.6f}"
                self._warn_usage(note)
            else:
                inp, out, cost, note = reply.input_tokens, reply.output_tokens, self.config.cost_usd(
                    reply.input_tokens, reply.output_tokens), ""
            if not reply.text.strip():
                message = f"{self.name}: the answer has no text (finish_reason={reply.finish_reason!r})"
                self._book(records, reservation, purpose, "bad_response", inp, out, cost, latency,
                           message + (f"; {note}" if note else ""))
                raise self._failed(BadResponse(message), records)
            self._book(records, reservation, purpose, "ok", inp, out, cost, latency, note)
            return Completion(text=reply.text, model=self.name, input_tokens=inp, output_tokens=out,
                              cost_usd=sum(r.cost_usd for r in records), latency_s=time.monotonic() - start,
                              attempts=attempt, records=tuple(records))

    def _attempt(self, reservation: Reservation, messages: list[Message], system: str, temperature: float,
                 max_tokens: int) -> _Reply:
        """One HTTP exchange on a worker thread, waited for until the deadline or the ledger's
        close; the worker, abandoned, stops reading at its next chunk (or its own read timeout)
        and hands back nothing anyone books."""
        stop = reservation.abandoned
        done = threading.Event()
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["reply"] = self._send(messages, system, temperature, max_tokens, stop)
            except LLMError as e:
                box["error"] = e
            except Exception as e:  # whatever else a broken reply provokes in the SDK or the parser
                box["error"] = _Unusable(f"{self.name}: unusable reply: {type(e).__name__}: {e}"[:_ERROR_TEXT_CHARS])
            finally:
                done.set()

        deadline = time.monotonic() + self.config.timeout_s
        threading.Thread(target=work, name=f"cw-llm-call-{self.name}", daemon=True).start()
        abandoned = f"{self.name}: abandoned in flight: {{}}"
        while not done.wait(min(POLL_S, max(0.0, deadline - time.monotonic()))):
            if stop.is_set():
                raise Abandoned(abandoned.format(self.ledger.closed or "the call was cancelled"))
            if time.monotonic() >= deadline:
                stop.set()
                raise LLMTimeout(f"{self.name}: no complete reply within timeout_s={self.config.timeout_s:g} s "
                                 "(connect and every read together)")
        if isinstance(box.get("error"), Abandoned):  # the worker saw the close first: the caller's reason
            raise Abandoned(abandoned.format(self.ledger.closed or "the call was cancelled"))
        if "error" in box:
            raise box["error"]
        return box["reply"]

    def _book(self, records: list[CallRecord], reservation: Reservation | None, purpose: str, outcome: str,
              input_tokens: int, output_tokens: int, cost: float, latency_s: float, message: str) -> None:
        rec = CallRecord(model=self.name, purpose=purpose, outcome=outcome, input_tokens=input_tokens,
                         output_tokens=output_tokens, cost_usd=cost, latency_s=latency_s, message=message)
        if reservation is None:
            self.ledger.record(rec)
        elif not self.ledger.settle(reservation, rec):
            return
        records.append(rec)

    @staticmethod
    def _failed(error: LLMError, records: list[CallRecord]) -> LLMError:
        error.records = tuple(records)
        return error

    def _warn_usage(self, note: str) -> None:
        if not self._warned_usage:
            self._warned_usage = True
            warnings.warn(f"{self.name}: {note} (warned once per model; every such reply is charged so)",
                          RuntimeWarning, stacklevel=3)

    def _wait_s(self, retry: int, error: LLMError) -> float:
        """Seconds before retry number `retry` (0 = the first): Retry-After if given, else backoff."""
        if isinstance(error, RateLimited) and error.retry_after_s is not None:
            return min(error.retry_after_s, MAX_RETRY_AFTER_S)
        return min(self.config.backoff_s * 2 ** retry * self._rng.uniform(0.5, 1.5), MAX_BACKOFF_S)

    @abstractmethod
    def _send(self, messages: list[Message], system: str, temperature: float, max_tokens: int,
              stop: threading.Event) -> _Reply:
        """One HTTP exchange (on a worker thread; give up when `stop` is set); raises the
        LLMError matching a failure."""


def _import_sdk(name: str) -> ModuleType:
    try:
        return __import__(name)
    except ModuleNotFoundError:
        raise ImportError(f"the {name!r} SDK is not installed: pip install 'commweave[llm]' "
                          f"(or pip install {name})") from None


def _connection(config: ModelConfig) -> tuple[str | None, str]:
    """The base URL and key to use: the config's, else the provider's environment variables; a
    server given by URL may go without a key (local servers do)."""
    base_url = config.base_url or os.environ.get(DEFAULT_BASE_URL_ENV[config.provider]) or None
    key_env = config.api_key_env or DEFAULT_KEY_ENV[config.provider]
    key = os.environ.get(key_env)
    if key:
        return base_url, key
    if base_url is not None:
        return base_url, LOCAL_PLACEHOLDER_KEY
    raise ValueError(f"model {config.name!r} ({config.provider}:{config.model}) needs an API key: set {key_env}, "
                     "or give the model a base_url if it is a local server that needs none")


def _retry_after_s(headers: Any) -> float | None:
    """Seconds the server asks us to wait: retry-after-ms, else Retry-After (seconds or an HTTP date)."""
    if headers is None:
        return None
    try:
        if headers.get("retry-after-ms") is not None:
            return max(0.0, float(headers["retry-after-ms"]) / 1000)
        value = headers.get("retry-after")
        if value is None:
            return None
        try:
            return max(0.0, float(value))
        except ValueError:
            when = email.utils.parsedate_to_datetime(value)
            return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _error_message(error: Any) -> str:
    """The server's own words: OpenAI's body is the error object, Anthropic's wraps it in 'error'."""
    body = error.body
    if isinstance(body, dict):
        inner = body.get("error") if isinstance(body.get("error"), dict) else body
        if isinstance(inner.get("message"), str):
            return inner["message"]
    return str(error.message)


def _translate(sdk: ModuleType, error: Exception, name: str) -> LLMError:
    """The LLMError for an exception of the openai / anthropic SDK (they share these classes)."""
    if isinstance(error, sdk.APITimeoutError):
        return LLMTimeout(f"{name}: no answer within the timeout")
    if isinstance(error, sdk.APIConnectionError):
        return ServerError(f"{name}: connection failed: {error}"[:_ERROR_TEXT_CHARS])
    if isinstance(error, sdk.APIStatusError):
        status = error.status_code
        text = f"{name}: HTTP {status}: {_error_message(error)}"[:_ERROR_TEXT_CHARS]
        if status == 429:
            return RateLimited(text, _retry_after_s(getattr(error.response, "headers", None)))
        if status == 408:
            return LLMTimeout(text)
        if status >= 500:
            return ServerError(text)
        return BadResponse(text)
    return BadResponse(f"{name}: unusable response: {error}"[:_ERROR_TEXT_CHARS])


def _read_body(response: Any, limit: int, stop: threading.Event, name: str) -> bytes:
    """The reply's body, chunk by chunk as it arrives, refused past `limit` bytes (declared or
    received) and given up when `stop` is set."""
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _Unusable(f"{name}: the reply's body is {int(declared)} bytes, over max_reply_bytes={limit} "
                        "(raise it in the model's config); not read")
    chunks: list[bytes] = []
    size = 0
    try:
        for chunk in response.iter_bytes():
            if stop.is_set():
                raise Abandoned(f"{name}: reading abandoned")
            size += len(chunk)
            if size > limit:
                raise _Unusable(f"{name}: the reply's body passed max_reply_bytes={limit} "
                                "(raise it in the model's config); not read further")
            chunks.append(chunk)
    except LLMError:
        raise
    except Exception as e:  # the HTTP library's errors (httpx or httpx2, whichever the SDK uses)
        if any(c.__name__ == "TimeoutException" for c in type(e).__mro__):
            raise LLMTimeout(f"{name}: the reply stopped arriving ({type(e).__name__})") from e
        raise _Unusable(f"{name}: the reply's body was cut off after {size} bytes: {type(e).__name__}: {e}"
                        [:_ERROR_TEXT_CHARS]) from e
    return b"".join(chunks)


def _json_body(body: bytes, name: str) -> dict[str, Any]:
    """The body as a JSON object; _Unusable saying what it is instead (truncated, HTML, ...)."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        head = body[:_HEAD_CHARS].decode("utf-8", "replace")
        if head.lstrip().lower().startswith(("<!doctype", "<html")):
            what = "an HTML page, not JSON"
        elif isinstance(e, json.JSONDecodeError) and body.lstrip()[:1] in (b"{", b"["):
            what = f"truncated or malformed JSON ({e.msg} at byte {e.pos})"
        else:
            what = "not JSON"
        raise _Unusable(f"{name}: the reply's body ({len(body)} bytes) is {what}; it begins {head!r}") from None
    if not isinstance(data, dict):
        raise _Unusable(f"{name}: the reply's body is JSON but not an object: {type(data).__name__}")
    error = data.get("error")
    if error:
        text = error.get("message", error) if isinstance(error, dict) else error
        raise _Unusable(f"{name}: the reply carries an error: {text}"[:_ERROR_TEXT_CHARS])
    return data


def _count(value: Any, field: str, name: str) -> int:
    """A token count from a reply's usage; _Unusable for a negative or non-integer one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 0:
        raise _Unusable(f"{name}: the reply's usage.{field} is {value!r}, not a token count >= 0")
    return int(value)


def _usage(data: dict[str, Any], input_field: str, output_field: str, max_tokens: int,
           name: str) -> tuple[int | None, int | None]:
    """(input, output) tokens of a reply's usage; (None, None) when it states none (some local
    servers omit it); _Unusable when its counts are not counts, or more output than was allowed."""
    usage = data.get("usage")
    if usage is None or (isinstance(usage, dict) and input_field not in usage and output_field not in usage):
        return None, None
    if not isinstance(usage, dict):
        raise _Unusable(f"{name}: the reply's usage is {usage!r}, not an object")
    if usage.get(input_field) is None or usage.get(output_field) is None:
        return None, None
    inp = _count(usage[input_field], input_field, name)
    out = _count(usage[output_field], output_field, name)
    if out > max_tokens:
        raise _Unusable(f"{name}: the reply's usage.{output_field}={out} is over the max_tokens={max_tokens} asked for")
    return inp, out


class OpenAIChatClient(LLMClient):
    """Any server speaking OpenAI's chat-completions protocol."""

    def __init__(self, config: ModelConfig, ledger: Ledger | None = None):
        super().__init__(config, ledger)
        self._sdk = _import_sdk("openai")
        base_url, key = _connection(config)
        self._client = self._sdk.OpenAI(base_url=base_url, api_key=key, timeout=config.timeout_s, max_retries=0)
        # OpenAI's own API rejects max_tokens for its reasoning models; other servers know only max_tokens
        official = base_url is None or "api.openai.com" in base_url
        self._max_tokens_param = "max_completion_tokens" if official else "max_tokens"

    def _send(self, messages: list[Message], system: str, temperature: float, max_tokens: int,
              stop: threading.Event) -> _Reply:
        chat = ([{"role": "system", "content": system}] if system else []) + [
            {"role": m.role, "content": m.content} for m in messages]
        try:
            with self._client.chat.completions.with_streaming_response.create(
                    model=self.config.model, messages=chat, temperature=temperature,
                    **{self._max_tokens_param: max_tokens}) as response:
                body = _read_body(response, self.config.max_reply_bytes, stop, self.name)
        except self._sdk.OpenAIError as e:
            raise _translate(self._sdk, e, self.name) from e
        data = _json_body(body, self.name)
        choices = data.get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        message = first.get("message") if isinstance(first, dict) else None
        if not isinstance(message, dict):
            raise _Unusable(f"{self.name}: the reply has no choices[0].message")
        text = message.get("content") or ""
        if not isinstance(text, str):
            raise _Unusable(f"{self.name}: the reply's choices[0].message.content is {type(text).__name__}, not text")
        inp, out = _usage(data, "prompt_tokens", "completion_tokens", max_tokens, self.name)
        return _Reply(text, inp, out, str(first.get("finish_reason")))


class AnthropicClient(LLMClient):
    """Anthropic's messages API. No temperature is sent: API version 2026-10-21 (the SDK's 2.x
    default) rejects sampling parameters, so Claude samples at its default whatever the caller asks."""

    def __init__(self, config: ModelConfig, ledger: Ledger | None = None):
        super().__init__(config, ledger)
        self._sdk = _import_sdk("anthropic")
        base_url, key = _connection(config)
        self._client = self._sdk.Anthropic(base_url=base_url, api_key=key, timeout=config.timeout_s, max_retries=0)

    def _send(self, messages: list[Message], system: str, temperature: float, max_tokens: int,
              stop: threading.Event) -> _Reply:
        kwargs: dict[str, Any] = {"system": system} if system else {}
        try:
            with self._client.messages.with_streaming_response.create(
                    model=self.config.model, max_tokens=max_tokens,
                    messages=[{"role": m.role, "content": m.content} for m in messages], **kwargs) as response:
                body = _read_body(response, self.config.max_reply_bytes, stop, self.name)
        except self._sdk.AnthropicError as e:
            raise _translate(self._sdk, e, self.name) from e
        data = _json_body(body, self.name)
        blocks = data.get("content")
        if not isinstance(blocks, list):
            raise _Unusable(f"{self.name}: the reply has no content blocks")
        texts = [b.get("text") for b in blocks if isinstance(b, dict) and b.get("type") == "text"]
        if not all(isinstance(t, str) for t in texts):
            raise _Unusable(f"{self.name}: a text block of the reply holds no text")
        inp, out = _usage(data, "input_tokens", "output_tokens", max_tokens, self.name)
        return _Reply("".join(texts), inp, out, str(data.get("stop_reason")))


def client_for(config: ModelConfig, ledger: Ledger | None = None) -> LLMClient:
    """The client for `config`'s provider; clients of one run share one ledger."""
    if config.provider == "openai":
        return OpenAIChatClient(config, ledger)
    if config.provider == "anthropic":
        return AnthropicClient(config, ledger)
    raise ValueError(f"no client for provider {config.provider!r}")
