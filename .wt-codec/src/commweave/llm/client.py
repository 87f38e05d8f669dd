"""Chat completions from any OpenAI-compatible server (OpenAI, vLLM, SGLang, llama.cpp, Ollama, ...)
or Anthropic's messages API, through the official SDKs (the optional extra `commweave[llm]`).

The SDKs' own retries are off: our loop retries instead (429 honouring Retry-After, 5xx, timeouts,
lost connections; exponential backoff with jitter), so that every attempt becomes a CallRecord in
the run's ledger and the budget is checked before each one.
"""

from __future__ import annotations

import email.utils
import os
import random
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from commweave.llm.config import DEFAULT_BASE_URL_ENV, DEFAULT_KEY_ENV, ModelConfig
from commweave.llm.ledger import (BadResponse, BudgetExceeded, CallRecord, LLMError, LLMTimeout, Ledger,
                                  RateLimited, ServerError)

ROLES = ("user", "assistant")
MAX_RETRY_AFTER_S = 60.0  # a server asking for longer is not waited for longer than this
MAX_BACKOFF_S = 60.0
LOCAL_PLACEHOLDER_KEY = "not-needed"  # local servers ignore the key, the SDKs insist on one
_ERROR_TEXT_CHARS = 500


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
    input_tokens: int
    output_tokens: int
    cost_usd: float
    latency_s: float  # from the call to the answer, retries and backoff included
    attempts: int  # HTTP attempts this completion took (1 = no retry)


@dataclass(frozen=True)
class _Reply:
    """What one successful HTTP exchange returned, before validation."""

    text: str
    input_tokens: int
    output_tokens: int
    finish_reason: str


class LLMClient(ABC):
    """One configured model; `complete` sends a conversation and retries transient failures."""

    def __init__(self, config: ModelConfig, ledger: Ledger | None = None):
        self.config = config
        self.name = config.name
        self.ledger = ledger if ledger is not None else Ledger()
        self._rng = random.Random()  # backoff jitter only

    def complete(self, messages: list[Message], *, system: str = "", temperature: float = 0.7,
                 max_tokens: int | None = None, purpose: str = "propose") -> Completion:
        """The model's answer. Raises BudgetExceeded (before sending) once the ledger is spent,
        BadResponse at once for a 4xx other than 429 or an empty answer, and the error of the last
        attempt once `max_retries` retries of 429 / 5xx / timeouts are used up."""
        if not messages:
            raise ValueError("complete() needs at least one message")
        if self.config.temperature is not None:
            temperature = self.config.temperature
        if max_tokens is None:
            max_tokens = self.config.max_tokens
        start = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                self.ledger.check()
            except BudgetExceeded as e:
                self._record(purpose, "budget", 0, 0, 0.0, 0.0, e.message)
                raise
            t0 = time.monotonic()
            try:
                reply = self._send(messages, system, temperature, max_tokens)
            except (RateLimited, ServerError, LLMTimeout) as e:
                self._record(purpose, e.kind, 0, 0, 0.0, time.monotonic() - t0, e.message)
                if attempt > self.config.max_retries:
                    raise
                time.sleep(self._wait_s(attempt - 1, e))
                continue
            except LLMError as e:
                self._record(purpose, e.kind, 0, 0, 0.0, time.monotonic() - t0, e.message)
                raise
            latency = time.monotonic() - t0
            cost = self.config.cost_usd(reply.input_tokens, reply.output_tokens)
            if not reply.text.strip():
                message = f"{self.name}: the answer has no text (finish_reason={reply.finish_reason!r})"
                self._record(purpose, "bad_response", reply.input_tokens, reply.output_tokens, cost, latency, message)
                raise BadResponse(message)
            self._record(purpose, "ok", reply.input_tokens, reply.output_tokens, cost, latency, "")
            return Completion(text=reply.text, model=self.name, input_tokens=reply.input_tokens,
                              output_tokens=reply.output_tokens, cost_usd=cost,
                              latency_s=time.monotonic() - start, attempts=attempt)

    def _record(self, purpose: str, outcome: str, input_tokens: int, output_tokens: int, cost: float,
                latency_s: float, message: str) -> None:
        self.ledger.record(CallRecord(model=self.name, purpose=purpose, outcome=outcome, input_tokens=input_tokens,
                                      output_tokens=output_tokens, cost_usd=cost, latency_s=latency_s, message=message))

    def _wait_s(self, retry: int, error: LLMError) -> float:
        """Seconds before retry number `retry` (0 = the first): Retry-After if given, else backoff."""
        if isinstance(error, RateLimited) and error.retry_after_s is not None:
            return min(error.retry_after_s, MAX_RETRY_AFTER_S)
        return min(self.config.backoff_s * 2 ** retry * self._rng.uniform(0.5, 1.5), MAX_BACKOFF_S)

    @abstractmethod
    def _send(self, messages: list[Message], system: str, temperature: float, max_tokens: int) -> _Reply:
        """One HTTP exchange; raises the LLMError matching a failure."""


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


def _usage(usage: Any, input_field: str, output_field: str) -> tuple[int, int]:
    if usage is None:  # some local servers omit it
        return 0, 0
    return int(getattr(usage, input_field, 0) or 0), int(getattr(usage, output_field, 0) or 0)


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

    def _send(self, messages: list[Message], system: str, temperature: float, max_tokens: int) -> _Reply:
        chat = ([{"role": "system", "content": system}] if system else []) + [
            {"role": m.role, "content": m.content} for m in messages]
        try:
            resp = self._client.chat.completions.create(model=self.config.model, messages=chat, temperature=temperature,
                                                        **{self._max_tokens_param: max_tokens})
        except self._sdk.OpenAIError as e:
            raise _translate(self._sdk, e, self.name) from e
        choices = getattr(resp, "choices", None)
        if not choices or getattr(choices[0], "message", None) is None:
            raise BadResponse(f"{self.name}: the response has no choices[0].message")
        inp, out = _usage(getattr(resp, "usage", None), "prompt_tokens", "completion_tokens")
        return _Reply(choices[0].message.content or "", inp, out, str(choices[0].finish_reason))


class AnthropicClient(LLMClient):
    """Anthropic's messages API. No temperature is sent: API version 2026-10-21 (the SDK's 2.x
    default) rejects sampling parameters, so Claude samples at its default whatever the caller asks."""

    def __init__(self, config: ModelConfig, ledger: Ledger | None = None):
        super().__init__(config, ledger)
        self._sdk = _import_sdk("anthropic")
        base_url, key = _connection(config)
        self._client = self._sdk.Anthropic(base_url=base_url, api_key=key, timeout=config.timeout_s, max_retries=0)

    def _send(self, messages: list[Message], system: str, temperature: float, max_tokens: int) -> _Reply:
        kwargs: dict[str, Any] = {"system": system} if system else {}
        try:
            resp = self._client.messages.create(model=self.config.model, max_tokens=max_tokens,
                                                messages=[{"role": m.role, "content": m.content} for m in messages],
                                                **kwargs)
        except self._sdk.AnthropicError as e:
            raise _translate(self._sdk, e, self.name) from e
        blocks = getattr(resp, "content", None)
        if blocks is None:
            raise BadResponse(f"{self.name}: the response has no content")
        text = "".join(b.text for b in blocks if getattr(b, "type", None) == "text")
        inp, out = _usage(getattr(resp, "usage", None), "input_tokens", "output_tokens")
        return _Reply(text, inp, out, str(getattr(resp, "stop_reason", None)))


def client_for(config: ModelConfig, ledger: Ledger | None = None) -> LLMClient:
    """The client for `config`'s provider; clients of one run share one ledger."""
    if config.provider == "openai":
        return OpenAIChatClient(config, ledger)
    if config.provider == "anthropic":
        return AnthropicClient(config, ledger)
    raise ValueError(f"no client for provider {config.provider!r}")
