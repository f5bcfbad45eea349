"""``CompletionsServer``: :class:`~.openai_server.LocalOpenAIServer` plus the legacy
``POST /v1/completions`` route that frozen sampling sources post token-id prompts to (as
vLLM and llama.cpp servers accept).

The reply text is fixed (``reply``), cut to ``max_tokens`` tokens of the given tokenizer
(finish reason "length", else "stop"); when the request asks for log-probs the choice
carries ``logprobs.token_logprobs`` ``-(i + 1) / 8`` for reply token i (exact in binary, so
order and alignment can be checked exactly). Requests are recorded, bearer keys checked and
faults injected as by ``LocalOpenAIServer``.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from composer_replication.testing.openai_server import (
    LocalOpenAIServer,
    RecordedRequest,
    _Handler,
    _Server,
)

__all__ = ["DEFAULT_REPLY", "CompletionsServer"]

DEFAULT_REPLY = "def add(a, b):\n    return a + b"


class _CompletionsHandler(_Handler):
    def do_POST(self) -> None:
        if self.path.rstrip("/") not in ("/v1/completions", "/completions"):
            super().do_POST()
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length))
        self.server.owner.complete(self, body)


class CompletionsServer(LocalOpenAIServer):
    """LocalOpenAIServer plus ``POST /v1/completions`` (token-id or text prompts).

    Args:
        tokenizer: cuts the reply to ``max_tokens`` tokens.
        reply: the completion text of every request.
        with_logprobs: answer a log-prob request (False: a server that never does).
        logprob_shift: extra log-prob entries (a server whose count is off).
        **kwargs: ``LocalOpenAIServer``'s (``api_key``, ``port``, ...).
    """

    def __init__(
        self,
        tokenizer: Any,
        reply: str = DEFAULT_REPLY,
        *,
        with_logprobs: bool = True,
        logprob_shift: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.tokenizer = tokenizer
        self.reply = reply
        self.with_logprobs = with_logprobs
        self.logprob_shift = logprob_shift

    def start(self) -> CompletionsServer:
        self._stop.clear()
        self._server = _Server(self._addr, _CompletionsHandler)
        self._server.owner = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def complete(self, handler: Any, body: dict[str, Any]) -> None:
        model, prompt = body["model"], body["prompt"]
        auth = handler.headers.get("Authorization")
        fault = self._next_fault(model, body)
        with self._state.lock:
            self._state.requests.append(
                RecordedRequest(
                    model,
                    [{"role": "user", "content": prompt}],
                    body,
                    auth,
                    time.monotonic(),
                    fault.kind if fault else None,
                )
            )
        if self.api_key is not None and auth != f"Bearer {self.api_key}":
            handler._send_json(401, {"error": {"message": "invalid API key", "code": 401}})
            return
        if fault is not None and fault.kind == "status":
            error = {"error": {"message": "injected", "code": fault.status}}
            handler._send_json(fault.status, error)
            return
        ids = self.tokenizer(self.reply, add_special_tokens=False)["input_ids"]
        finish = "stop"
        if len(ids) > body["max_tokens"]:
            ids, finish = ids[: body["max_tokens"]], "length"
        text = self.tokenizer.decode(ids)
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish}
        if self.with_logprobs and body.get("logprobs") is not None:
            n = len(ids) + self.logprob_shift
            choice["logprobs"] = {"token_logprobs": [-(i + 1) / 8 for i in range(n)]}
        handler._send_json(200, {"object": "text_completion", "model": model, "choices": [choice]})
