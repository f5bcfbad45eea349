"""``EndpointSampler`` (the frozen HTTP sampling source) against the project's local
OpenAI-compatible server on 127.0.0.1.

The sampler posts token-id prompts to the legacy ``/v1/completions`` route (as vLLM and
llama.cpp servers accept): ``testing.CompletionsServer`` is ``LocalOpenAIServer`` (its
lifecycle, request recording, bearer key and fault queue) with that route added. Its reply
is cut to ``max_tokens`` tokens of the policy's tokenizer ("length") and carries per-token
``logprobs.token_logprobs`` ``-(i + 1) / 8`` for reply token i when asked for (exact in
binary, so the test can check order and alignment exactly).
"""

from __future__ import annotations

import httpx
import pytest

from composer_replication.config.references import FrozenEndpoint
from composer_replication.rollout.endpoint_sampler import EndpointSampler, frozen_source
from composer_replication.samples.generation import SamplingSettings
from composer_replication.testing import CompletionsServer, Fault
from composer_replication.testing.completions_server import DEFAULT_REPLY as REPLY

pytestmark = pytest.mark.integration


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


def test_a_frozen_endpoint_reference_samples_through_its_sampler(tokenizer):
    with CompletionsServer(tokenizer) as server:
        reference = FrozenEndpoint(name="frozen", base_url=server.base_url)
        source = frozen_source(reference)
        assert isinstance(source, EndpointSampler) and not source.samples_from_live_policy
        assert (source.base_url, source.model) == (server.base_url, "frozen")
        announced = []
        (gen,) = source.sample_batch(
            tokenizer,
            _prompts(tokenizer)[:1],
            SamplingSettings(),
            on_row_done=lambda i, g: announced.append((i, g)),
        )
        assert announced == [(0, gen)]
        # a caller that reads no log-probs does not ask for them (and gets zeros)
        (quiet,) = source.sample_batch(
            tokenizer, _prompts(tokenizer)[:1], SamplingSettings(logprobs=False)
        )
        assert "logprobs" in server.requests[0].body
        assert "logprobs" not in server.requests[1].body
        assert quiet.completion_ids == gen.completion_ids
        assert gen.logprobs[0] == -0.125 and quiet.logprobs == [0.0] * len(gen.logprobs)
        base_url = server.base_url
    assert gen.text == REPLY and gen.finish_reason == "stop"
    # the server is stopped: nothing listens on its port any more
    with pytest.raises(RuntimeError, match="not running"):
        _ = server.base_url
    stopped = EndpointSampler(base_url, "frozen", max_retries=0, timeout_s=2.0)
    with pytest.raises(httpx.TransportError):
        stopped.sample_batch(tokenizer, _prompts(tokenizer)[:1], SamplingSettings())
