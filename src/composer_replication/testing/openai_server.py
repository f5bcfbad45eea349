"""A real OpenAI-compatible chat-completions server on 127.0.0.1, for tests and benchmarks.

`LocalOpenAIServer` runs the stdlib `ThreadingHTTPServer` (one thread per connection,
HTTP/1.1 keep-alive) in a background thread and speaks:

- `POST /v1/chat/completions`: `{"model", "messages", "max_tokens"?}` -> a chat completion
  whose text comes from `responder(model, messages)` and whose `usage` counts prompt and
  completion tokens with `token_counter` (default: ceil(chars / 4)) plus 4 tokens per
  message and 3 for the reply's priming, like OpenAI's accounting. With
  `honour_max_tokens=True` (default) a reply longer than `max_tokens` is cut to fit and
  finishes with "length"; False lets replies overrun (to measure budget overshoot).
- `GET /v1/models`: the models seen so far; `GET /_stats`: `{"requests", "max_in_flight"}`.

Faults for the client's error paths, consumed first-in first-out per model (or for any
model) with `add_faults`, or decided per request by `fault_fn`: an HTTP status (with
`Retry-After`), a malformed JSON body, a body without choices, a completion without usage,
a hang (no answer for `delay_s`, then the connection is closed) and a dropped connection.
`latency_s` delays every answer (a float, or a callable of the model). Every request is
recorded (`requests`, `request_count`) and the peak number of requests being served at
once is kept (`max_in_flight`).

What it does not do: streaming, tools, authentication beyond one optional bearer key.
`python -m composer_replication.testing` runs one in the foreground (see `--help`).
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

__all__ = ["Fault", "LocalOpenAIServer", "RecordedRequest", "char_token_count", "echo_responder"]

FaultKind = Literal["status", "malformed", "no_choices", "no_usage", "hang", "drop"]
Responder = Callable[[str, list[dict[str, Any]]], str]


@dataclass(frozen=True)
class Fault:
    """One injected misbehaviour.

    Attributes:
        kind: "status" (answer `status`, with `retry_after` as the Retry-After header if
            set), "malformed" (200 with a body that is not JSON), "no_choices" (200 JSON
            without choices), "no_usage" (a normal completion without `usage`), "hang"
            (answer nothing for `delay_s` seconds, then close), "drop" (close at once).
        status: the HTTP status for kind "status".
        retry_after: the Retry-After header value (seconds or an HTTP date).
        delay_s: how long a "hang" lasts.
    """

    kind: FaultKind
    status: int = 500
    retry_after: str | None = None
    delay_s: float = 30.0


@dataclass(frozen=True)
class RecordedRequest:
    """A chat-completions request as the server received it."""

    model: str
    messages: list[dict[str, Any]]
    body: dict[str, Any]
    authorization: str | None
    received_at: float  # time.monotonic()
    fault: str | None


def char_token_count(text: str) -> int:
    """ceil(len(text) / 4): the usual rough chars-per-token of English and code."""
    return math.ceil(len(text) / 4)


def echo_responder(model: str, messages: list[dict[str, Any]]) -> str:
    """Default reply: names the model and quotes the start of the last message."""
    last = messages[-1].get("content", "") if messages else ""
    return f"[{model}] {str(last)[:60]}"


@dataclass
class _State:
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: list[RecordedRequest] = field(default_factory=list)
    faults: dict[str | None, deque[Fault]] = field(default_factory=dict)
    in_flight: int = 0
    max_in_flight: int = 0
    models: set[str] = field(default_factory=set)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as separate writes
    timeout = 60  # idle keep-alive connections end instead of pinning a thread forever
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output clean

    def _send_json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        self._send_raw(status, json.dumps(payload).encode("utf-8"), headers)

    def _send_raw(self, status: int, data: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        owner = self.server.owner
        if self.path.rstrip("/") == "/_stats":  # counters, for a server in another process
            self._send_json(
                200, {"requests": owner.request_count, "max_in_flight": owner.max_in_flight}
            )
        elif self.path.rstrip("/") in ("/v1/models", "/models"):
            with owner._state.lock:
                models = sorted(owner._state.models)
            data = [{"id": m, "object": "model", "owned_by": "local"} for m in models]
            self._send_json(200, {"object": "list", "data": data})
        else:
            self._send_json(404, {"error": {"message": f"no route {self.path}", "code": 404}})

    def do_POST(self) -> None:
        if self.path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
            self._send_json(404, {"error": {"message": f"no route {self.path}", "code": 404}})
            return
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
            model = body["model"]
            messages = body["messages"]
            if not isinstance(model, str) or not isinstance(messages, list):
                raise TypeError("model must be a string and messages a list")
        except (ValueError, KeyError, TypeError) as exc:
            self._send_json(400, {"error": {"message": f"bad request: {exc}", "code": 400}})
            return
        self.server.owner._serve(self, model, messages, body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 512  # a burst of connects must not overflow the listen backlog
    owner: LocalOpenAIServer


class LocalOpenAIServer:
    """Context manager: `with LocalOpenAIServer(...) as server: server.base_url ...`.

    Args:
        responder: `(model, messages) -> reply text`, called from server threads.
        latency_s: seconds before each answer; a float or `(model) -> float`.
        api_key: if set, requests must carry `Authorization: Bearer <api_key>` (else 401).
        token_counter: tokens of a text, for `usage` (default `char_token_count`).
        honour_max_tokens: cut replies to the request's `max_tokens`.
        fault_fn: `(model, body) -> Fault | None`, asked before the queued faults.
        host / port: where to listen (port 0: any free port).
    """

    def __init__(
        self,
        responder: Responder | None = None,
        *,
        latency_s: float | Callable[[str], float] = 0.0,
        api_key: str | None = None,
        token_counter: Callable[[str], int] = char_token_count,
        honour_max_tokens: bool = True,
        fault_fn: Callable[[str, dict[str, Any]], Fault | None] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.responder = responder or echo_responder
        self.latency_s = latency_s
        self.api_key = api_key
        self.token_counter = token_counter
        self.honour_max_tokens = honour_max_tokens
        self.fault_fn = fault_fn
        self._addr = (host, port)
        self._state = _State()
        self._stop = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> LocalOpenAIServer:
        if self._server is not None:
            raise RuntimeError("the server is already running; call stop() first")
        self._stop.clear()
        self._server = _Server(self._addr, _Handler)
        self._server.owner = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._stop.set()  # wakes handlers sleeping in latency or a hang
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = self._thread = None

    def __enter__(self) -> LocalOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        """`http://127.0.0.1:<port>/v1`, the root an OpenAI client expects."""
        if self._server is None:
            raise RuntimeError("the server is not running; use it as a context manager")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    # ------------------------------------------------------------------ scripting

    def add_faults(self, *faults: Fault, model: str | None = None) -> None:
        """Queue faults for the next requests to `model` (None: to any model)."""
        with self._state.lock:
            self._state.faults.setdefault(model, deque()).extend(faults)

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._state.lock:
            return list(self._state.requests)

    @property
    def request_count(self) -> int:
        with self._state.lock:
            return len(self._state.requests)

    @property
    def max_in_flight(self) -> int:
        with self._state.lock:
            return self._state.max_in_flight

    def reset_counts(self) -> None:
        """Forget recorded requests and the in-flight peak (queued faults stay)."""
        with self._state.lock:
            self._state.requests.clear()
            self._state.max_in_flight = self._state.in_flight

    # ------------------------------------------------------------------ serving

    def _next_fault(self, model: str, body: dict[str, Any]) -> Fault | None:
        if self.fault_fn is not None:
            fault = self.fault_fn(model, body)
            if fault is not None:
                return fault
        with self._state.lock:
            for key in (model, None):
                queue = self._state.faults.get(key)
                if queue:
                    return queue.popleft()
        return None

    def _serve(
        self, handler: _Handler, model: str, messages: list[dict[str, Any]], body: dict[str, Any]
    ) -> None:
        state = self._state
        auth = handler.headers.get("Authorization")
        fault = self._next_fault(model, body)
        with state.lock:
            state.requests.append(
                RecordedRequest(
                    model, messages, body, auth, time.monotonic(), fault.kind if fault else None
                )
            )
            state.models.add(model)
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            self._answer(handler, model, messages, body, auth, fault)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout); nothing to answer
        finally:
            with state.lock:
                state.in_flight -= 1

    def _answer(
        self,
        handler: _Handler,
        model: str,
        messages: list[dict[str, Any]],
        body: dict[str, Any],
        auth: str | None,
        fault: Fault | None,
    ) -> None:
        if self.api_key is not None and auth != f"Bearer {self.api_key}":
            handler._send_json(401, {"error": {"message": "invalid API key", "code": 401}})
            return
        if fault is not None and fault.kind in ("hang", "drop"):
            if fault.kind == "hang":
                self._stop.wait(fault.delay_s)
            handler.close_connection = True
            return
        latency = self.latency_s(model) if callable(self.latency_s) else self.latency_s
        if latency > 0:
            self._stop.wait(latency)
        if fault is not None and fault.kind == "status":
            headers = {"Retry-After": fault.retry_after} if fault.retry_after else None
            error = {"error": {"message": f"injected HTTP {fault.status}", "code": fault.status}}
            handler._send_json(fault.status, error, headers)
            return
        if fault is not None and fault.kind == "malformed":
            handler._send_raw(200, b'{"id": "chatcmpl-broken", "choices": [')
            return
        if fault is not None and fault.kind == "no_choices":
            handler._send_json(200, {"id": "chatcmpl-empty", "object": "chat.completion"})
            return
        handler._send_json(200, self._completion(model, messages, body, fault))

    def _completion(
        self,
        model: str,
        messages: list[dict[str, Any]],
        body: dict[str, Any],
        fault: Fault | None,
    ) -> dict[str, Any]:
        text = self.responder(model, messages)
        finish = "stop"
        max_tokens = body.get("max_tokens")
        if self.honour_max_tokens and isinstance(max_tokens, int):
            cut = self._cut_to_tokens(text, max_tokens)
            if cut != text:
                text, finish = cut, "length"
        prompt_tokens = 3 + sum(4 + self.token_counter(str(m.get("content", ""))) for m in messages)
        completion_tokens = self.token_counter(text)
        payload: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish,
                }
            ],
        }
        if fault is None or fault.kind != "no_usage":
            payload["usage"] = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            }
        return payload

    def _cut_to_tokens(self, text: str, max_tokens: int) -> str:
        """The longest prefix of `text` with at most `max_tokens` tokens (binary search)."""
        if self.token_counter(text) <= max_tokens:
            return text
        lo, hi = 0, len(text)  # counter(text[:lo]) <= max_tokens < counter(text[:hi])
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.token_counter(text[:mid]) <= max_tokens:
                lo = mid
            else:
                hi = mid
        return text[:lo]
