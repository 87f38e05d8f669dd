"""Real local HTTP servers that speak the LLM protocols and replay a script, for tests.

`ScriptedOpenAIServer` answers `POST /v1/chat/completions` (OpenAI's chat-completions protocol) and
`ScriptedAnthropicServer` answers `POST /v1/messages` (Anthropic's messages protocol). Each request
takes the next step of the script:

- `Reply(text, input_tokens=100, output_tokens=50)` (or just a string): a completion with that usage
  (`usage=False`: a completion stating no usage, as some local servers send);
- `Raw(body, status=200, content_type=...)`: these bytes as the body, whatever they are (truncated
  JSON, an HTML page, ...);
- `Trickle(text, interval_s)`: a completion whose body arrives one byte every `interval_s`;
- `Fail(status, retry_after=None, message=...)`: an HTTP error (429 with an optional Retry-After
  header, 500, 400, ...) with the provider's error JSON;
- `Stall(seconds)`: answer only after `seconds` (longer than the client's timeout_s: a timeout);
- a callable taking the request's JSON body and returning one of the above (answers that depend
  on the prompt, e.g. a diff against the program the prompt holds).

When the script is used up the server answers 500 "script exhausted". Each JSON body posted to the
endpoint is kept in `srv.requests` (headers in `srv.headers`, arrival times in `srv.times`);
`srv.prompt(i)` is request i's system prompt and messages as one string, for
`assert "..." in srv.prompt(0)`. `srv.model()` is a ModelConfig pointing at the server with
test-sized timeouts (1 s, backoff 0.01 s, 2 retries):

    with ScriptedOpenAIServer(["hello", Fail(429, retry_after="0"), Reply("x", 10, 5)]) as srv:
        client = client_for(srv.model(input_usd_per_mtok=1.0), Ledger())
        assert client.complete([Message("user", "hi")]).text == "hello"
        assert srv.requests[0]["messages"][-1]["content"] == "hi"

As a pytest fixture: `with ScriptedOpenAIServer(script) as srv: yield srv`. `srv.add(*steps)`
appends steps while the server runs.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Union

from commweave.llm import ModelConfig


@dataclass(frozen=True)
class Reply:
    text: str
    input_tokens: int = 100
    output_tokens: int = 50
    usage: bool = True  # False: the completion has no usage object


@dataclass(frozen=True)
class Raw:
    body: bytes
    status: int = 200
    content_type: str = "application/json"
    declare_length: bool = True  # False: no Content-Length, the body ends when the connection closes


@dataclass(frozen=True)
class Trickle:
    text: str
    interval_s: float = 0.2


@dataclass(frozen=True)
class Fail:
    status: int
    retry_after: str | None = None  # the Retry-After header's value, e.g. "0" or "0.2" (seconds)
    message: str = "scripted failure"


@dataclass(frozen=True)
class Stall:
    seconds: float
    text: str = "too late"


Answer = Union[Reply, Fail, Stall, Raw, Trickle, str]
Step = Union[Answer, Callable[[dict], Answer]]
_ANSWERS = (Reply, Fail, Stall, Raw, Trickle)


class _ScriptedServer:
    path = ""  # the endpoint, set by subclasses
    provider = ""

    def __init__(self, script: list[Step] | tuple[Step, ...] = ()):
        self._script = list(script)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.requests: list[dict] = []
        self.headers: list[dict[str, str]] = []  # each request's HTTP headers, names in lower case
        self.times: list[float] = []  # time.monotonic() at each request's arrival
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> "_ScriptedServer":
        handler = type("Handler", (_Handler,), {"server_owner": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stopping.set()  # stalled handlers return at once
        assert self._httpd is not None and self._thread is not None
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    @property
    def port(self) -> int:
        assert self._httpd is not None, "use the server inside `with`"
        return self._httpd.server_address[1]

    @property
    def base_url(self) -> str:
        raise NotImplementedError

    # --- script --------------------------------------------------------------------------------
    def add(self, *steps: Step) -> None:
        with self._lock:
            self._script.extend(steps)

    @property
    def remaining(self) -> int:
        """Steps not yet used."""
        return len(self._script)

    def model(self, name: str = "scripted", **overrides: Any) -> ModelConfig:
        """A ModelConfig for this server: timeout 1 s (a call's whole life, so with room for a loaded
        machine), backoff 0.01 s, 2 retries, unless overridden."""
        settings = dict(provider=self.provider, model="scripted-model", base_url=self.base_url,
                        timeout_s=1.0, backoff_s=0.01, max_retries=2)
        settings.update(overrides)
        return ModelConfig(name=name, **settings)

    def prompt(self, i: int) -> str:
        """Request i's system prompt and message texts, joined by newlines."""
        body = self.requests[i]
        parts = [body["system"]] if isinstance(body.get("system"), str) else []
        for m in body.get("messages", []):
            content = m.get("content")
            if isinstance(content, list):  # Anthropic's content blocks
                content = "".join(c.get("text", "") for c in content)
            parts.append(str(content))
        return "\n".join(parts)

    def _next(self, body: dict, headers: dict[str, str]) -> Reply | Fail | Stall | Raw | Trickle:
        with self._lock:
            self.requests.append(body)
            self.headers.append(headers)
            self.times.append(time.monotonic())
            step = self._script.pop(0) if self._script else Fail(500, message="script exhausted")
        if callable(step) and not isinstance(step, _ANSWERS):
            step = step(body)
        return Reply(step) if isinstance(step, str) else step

    # --- protocol ------------------------------------------------------------------------------
    def completion(self, body: dict, reply: Reply) -> dict:
        raise NotImplementedError

    def error(self, status: int, message: str) -> dict:
        raise NotImplementedError


class ScriptedOpenAIServer(_ScriptedServer):
    """OpenAI chat completions; base_url ends in /v1 as OpenAI-compatible servers' do."""

    path = "/v1/chat/completions"
    provider = "openai"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def completion(self, body: dict, reply: Reply) -> dict:
        return {"id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model", ""),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": reply.text},
                             "finish_reason": "stop"}]} | ({
                "usage": {"prompt_tokens": reply.input_tokens, "completion_tokens": reply.output_tokens,
                          "total_tokens": reply.input_tokens + reply.output_tokens}} if reply.usage else {})

    def error(self, status: int, message: str) -> dict:
        return {"error": {"message": message, "type": "scripted", "code": status}}


class ScriptedAnthropicServer(_ScriptedServer):
    """Anthropic messages; base_url without /v1, as the Anthropic SDK expects."""

    path = "/v1/messages"
    provider = "anthropic"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def completion(self, body: dict, reply: Reply) -> dict:
        return {"id": f"msg_{len(self.requests)}", "type": "message", "role": "assistant",
                "model": body.get("model", ""), "content": [{"type": "text", "text": reply.text}],
                "stop_reason": "end_turn", "stop_sequence": None} | ({
                "usage": {"input_tokens": reply.input_tokens, "output_tokens": reply.output_tokens}} if reply.usage else {})

    def error(self, status: int, message: str) -> dict:
        kind = {429: "rate_limit_error", 400: "invalid_request_error"}.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}


class _Handler(BaseHTTPRequestHandler):
    server_owner: _ScriptedServer

    def do_POST(self) -> None:
        owner = self.server_owner
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if self.path.split("?")[0] != owner.path:
            self._send(404, owner.error(404, f"no endpoint {self.path}; this server answers {owner.path}"))
            return
        step = owner._next(body, {k.lower(): v for k, v in self.headers.items()})
        if isinstance(step, Fail):
            headers = {"Retry-After": step.retry_after} if step.retry_after is not None else {}
            self._send(step.status, owner.error(step.status, step.message), headers)
            return
        if isinstance(step, Stall):
            if owner._stopping.wait(step.seconds):
                return
            step = Reply(step.text)
        if isinstance(step, Raw):
            self._send_bytes(step.status, step.body, step.content_type, declare_length=step.declare_length)
        elif isinstance(step, Trickle):
            self._trickle(json.dumps(owner.completion(body, Reply(step.text))).encode(), step.interval_s)
        else:
            self._send(200, owner.completion(body, step))

    def _send(self, status: int, payload: dict, headers: dict[str, str] | None = None) -> None:
        self._send_bytes(status, json.dumps(payload).encode(), "application/json", headers)

    def _send_bytes(self, status: int, data: bytes, content_type: str, headers: dict[str, str] | None = None,
                    declare_length: bool = True) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            if declare_length:
                self.send_header("Content-Length", str(len(data)))
            else:
                self.close_connection = True
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
            pass

    def _trickle(self, data: bytes, interval_s: float) -> None:
        """A 200 whose declared body arrives one byte per `interval_s` (until the client leaves)."""
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.flush()
            for i in range(len(data)):
                self.wfile.write(data[i:i + 1])
                self.wfile.flush()
                if self.server_owner._stopping.wait(interval_s):
                    return
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        pass
