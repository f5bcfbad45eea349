"""``EndpointSampler`` (the frozen HTTP sampling source) against the project's local
OpenAI-compatible server on 127.0.0.1.

``LocalOpenAIServer`` speaks chat completions; the sampler posts token-id prompts to the
legacy ``/v1/completions`` route (as vLLM and llama.cpp servers accept). The server below is
``LocalOpenAIServer`` (its lifecycle, request recording, bearer key and fault queue) with
that route added: the reply text comes from a responder, is cut to ``max_tokens`` tokens of
the policy's tokenizer ("length"), and carries per-token ``logprobs.token_logprobs``
``-(i + 1) / 8`` for reply token i when asked for (exact in binary, so the test can check
order and alignment exactly).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from composer_replication.config.references import FrozenEndpoint
from composer_replication.rollout.endpoint_sampler import EndpointSampler, sampling_source
from composer_replication.rollout.generate import SamplingSettings, generate
from composer_replication.testing import Fault, LocalOpenAIServer
from composer_replication.testing.openai_server import RecordedRequest, _Handler, _Server

pytestmark = pytest.mark.integration

REPLY = "def add(a, b):\n    return a + b"


class _CompletionsHandler(_Handler):
    def do_POST(self) -> None:
        if self.path.rstrip("/") not in ("/v1/completions", "/completions"):
            super().do_POST()
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length))
        self.server.owner.complete(self, body)


class CompletionsServer(LocalOpenAIServer):
    """LocalOpenAIServer plus ``POST /v1/completions`` (token-id or text prompts)."""

    def __init__(self, tokenizer, reply=REPLY, *, with_logprobs=True, logprob_shift=0, **kw):
        super().__init__(**kw)
        self.tokenizer = tokenizer
        self.reply = reply
        self.with_logprobs = with_logprobs
        self.logprob_shift = logprob_shift  # extra entries: a server whose count is off

    def start(self) -> CompletionsServer:
        self._stop.clear()
        self._server = _Server(self._addr, _CompletionsHandler)
        self._server.owner = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def complete(self, handler, body) -> None:
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
        choice = {"index": 0, "text": text, "finish_reason": finish}
        if self.with_logprobs and body.get("logprobs") is not None:
            n = len(ids) + self.logprob_shift
            choice["logprobs"] = {"token_logprobs": [-(i + 1) / 8 for i in range(n)]}
        handler._send_json(200, {"object": "text_completion", "model": model, "choices": [choice]})


def _prompts(tokenizer):
    return [
        tokenizer("write add(a, b)")["input_ids"],
        tokenizer("write a function that adds two numbers")["input_ids"],
    ]


def test_samples_text_tokens_and_logprobs_over_http(tokenizer):
    prompts = _prompts(tokenizer)
    settings = SamplingSettings(max_new_tokens=64, temperature=0.7, stop_strings=("</tool_call>",))
    with CompletionsServer(tokenizer) as server:
        sampler = EndpointSampler(server.base_url, "frozen-teacher")
        generations = sampler.sample_batch(tokenizer, prompts, settings)
        requests = server.requests
    ids = tokenizer(REPLY, add_special_tokens=False)["input_ids"]
    assert len(generations) == 2
    for prompt, gen in zip(prompts, generations):
        assert gen.prompt_ids == prompt
        assert gen.text == REPLY
        assert gen.completion_ids == ids  # the text, tokenised with the policy's tokenizer
        assert gen.logprobs == [-(i + 1) / 8 for i in range(len(ids))]
        assert gen.finish_reason == "stop"
    # what went over the wire: the token ids themselves, the settings, a log-prob request
    assert [r.body for r in requests] == [
        {
            "model": "frozen-teacher",
            "prompt": prompt,
            "max_tokens": 64,
            "temperature": 0.7,
            "logprobs": 0,
            "stop": ["</tool_call>"],
        }
        for prompt in prompts
    ]
    assert all(r.authorization is None for r in requests)


def test_max_tokens_cut_reports_length(tokenizer):
    with CompletionsServer(tokenizer) as server:
        (gen,) = EndpointSampler(server.base_url, "m").sample_batch(
            tokenizer, _prompts(tokenizer)[:1], SamplingSettings(max_new_tokens=3)
        )
    full = tokenizer(REPLY, add_special_tokens=False)["input_ids"]
    assert gen.finish_reason == "length"
    assert gen.text == tokenizer.decode(full[:3])
    assert gen.completion_ids == full[:3]
    assert gen.logprobs == [-0.125, -0.25, -0.375]
    assert "stop" not in server.requests[0].body  # no stop strings, no "stop" field


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [({"with_logprobs": False}, "no logprobs"), ({"logprob_shift": 1}, "one too many")],
)
def test_missing_or_misaligned_logprobs_become_zeros(tokenizer, kwargs, why):
    with CompletionsServer(tokenizer, **kwargs) as server:
        (gen,) = EndpointSampler(server.base_url, "m").sample_batch(
            tokenizer, _prompts(tokenizer)[:1], SamplingSettings(max_new_tokens=64)
        )
    assert gen.text == REPLY
    assert gen.logprobs == [0.0] * len(gen.completion_ids), why
    assert len(gen.completion_ids) > 0


def test_transient_status_is_retried_and_a_bad_key_is_not(tokenizer, monkeypatch):
    monkeypatch.setenv("FROZEN_KEY", "sk-local")
    with CompletionsServer(tokenizer, api_key="sk-local") as server:
        server.add_faults(Fault("status", status=503))
        sampler = EndpointSampler(server.base_url, "m", api_key_env="FROZEN_KEY")
        (gen,) = sampler.sample_batch(tokenizer, _prompts(tokenizer)[:1], SamplingSettings())
        assert gen.text == REPLY
        assert [r.fault for r in server.requests] == ["status", None]
        assert {r.authorization for r in server.requests} == {"Bearer sk-local"}
        monkeypatch.setenv("FROZEN_KEY", "sk-wrong")
        wrong = EndpointSampler(server.base_url, "m", api_key_env="FROZEN_KEY")
        with pytest.raises(httpx.HTTPStatusError, match="401"):
            wrong.sample_batch(tokenizer, _prompts(tokenizer)[:1], SamplingSettings())
        assert server.request_count == 3  # a 401 is final: no retry
    monkeypatch.delenv("FROZEN_KEY")
    with pytest.raises(RuntimeError, match="FROZEN_KEY"):
        EndpointSampler("http://127.0.0.1:9/v1", "m", api_key_env="FROZEN_KEY")


def test_a_frozen_endpoint_reference_samples_through_generate(tokenizer):
    with CompletionsServer(tokenizer) as server:
        reference = FrozenEndpoint(name="frozen", base_url=server.base_url)
        source = sampling_source(reference, policy=object())
        assert isinstance(source, EndpointSampler)
        assert (source.base_url, source.model) == (server.base_url, "frozen")
        (gen,) = generate(source, tokenizer, _prompts(tokenizer)[:1], SamplingSettings())
        base_url = server.base_url
    assert gen.text == REPLY and gen.finish_reason == "stop"
    # the server is stopped: nothing listens on its port any more
    with pytest.raises(RuntimeError, match="not running"):
        _ = server.base_url
    stopped = EndpointSampler(base_url, "frozen", max_retries=0, timeout_s=2.0)
    with pytest.raises(httpx.TransportError):
        stopped.sample_batch(tokenizer, _prompts(tokenizer)[:1], SamplingSettings())
