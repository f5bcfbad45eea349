"""Sampling from a frozen source: an OpenAI-compatible completions endpoint.

Used when an algorithm's ``sampling.source`` is a frozen endpoint (``sft`` distils a
teacher's samples). The prompt goes out as token ids (vLLM and llama.cpp servers accept a
list of ints as ``prompt``); the completion text comes back and is tokenised with the
policy's tokenizer. Log-probs are asked for only when ``settings.logprobs`` (an
environment's sampler asks a frozen source for none); the endpoint's token log-probs are
reported when the server returns them, else 0.0 (a frozen source feeds only non-rl
components, which do not read them).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from composer_replication.inference.decoding.generate import InProcessSampler
from composer_replication.rollout.demonstrations import ReferenceSolutions
from composer_replication.samples.generation import Generation, SamplingSettings

if TYPE_CHECKING:
    from composer_replication.roles import Sampler


class EndpointSampler:
    """A frozen sampling source behind ``{base_url}/completions`` (a
    :class:`~composer_replication.roles.Sampler` whose samples never come from the live
    policy)."""

    samples_from_live_policy = False

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key_env: str | None = None,
        timeout_s: float = 120.0,
        max_retries: int = 3,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = os.environ.get(api_key_env) if api_key_env else None
        if api_key_env and not self.api_key:
            raise RuntimeError(
                f"environment variable {api_key_env} (the endpoint's key) is not set"
            )
        self.timeout_s = timeout_s
        self.max_retries = max_retries

    def sample_batch(
        self,
        tokenizer: Any,
        prompts: Sequence[Sequence[int]],
        settings: SamplingSettings,
        *,
        max_rows: int | None = None,
        on_row_done: Callable[[int, Generation], None] | None = None,
    ) -> list[Generation]:
        """One request per prompt, in order (``max_rows`` does not apply: one row at a
        time); each completion is announced as it arrives."""
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        out = []
        with httpx.Client(timeout=self.timeout_s, headers=headers) as client:
            for prompt in prompts:
                body: dict[str, Any] = {
                    "model": self.model,
                    "prompt": list(prompt),
                    "max_tokens": settings.max_new_tokens,
                    "temperature": settings.temperature,
                }
                if settings.logprobs:
                    body["logprobs"] = 0
                if settings.stop_strings:
                    body["stop"] = list(settings.stop_strings)
                choice = self._post(client, body)["choices"][0]
                text = choice.get("text", "")
                ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
                logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
                if len(logprobs) != len(ids):
                    logprobs = [0.0] * len(ids)
                reason = {"stop": "stop", "length": "length"}.get(
                    choice.get("finish_reason"), "eos"
                )
                out.append(
                    Generation(list(prompt), ids, [float(x or 0.0) for x in logprobs], reason, text)
                )
                if on_row_done is not None:  # a grader can start on it at once
                    on_row_done(len(out) - 1, out[-1])
        return out

    def _post(self, client: Any, body: dict[str, Any]) -> dict[str, Any]:
        import httpx

        url = f"{self.base_url}/completions"
        for attempt in range(self.max_retries + 1):
            try:
                response = client.post(url, json=body)
                if response.status_code in (429, 500, 502, 503, 504) and attempt < self.max_retries:
                    time.sleep(min(2.0**attempt, 8.0))
                    continue
                response.raise_for_status()
                data = response.json()
                if not data.get("choices"):
                    raise ValueError(f"{url} returned no choices")
                return data
            except (httpx.TransportError, ValueError):
                if attempt >= self.max_retries:
                    raise
                time.sleep(min(2.0**attempt, 8.0))
        raise RuntimeError(f"{url}: retries exhausted")


def frozen_source(reference: Any) -> Sampler | ReferenceSolutions:
    """The frozen pool of a ``sampling.source`` reference other than ``"policy"`` (the
    live policy is each run's own: ``rollout.env_sampler.EnvSampler``): a frozen local
    model sampled in this process, a frozen endpoint, or for ``"reference"`` the marker
    that makes the environment answer with its reference solutions."""
    from composer_replication.config.references import REFERENCE_SOLUTIONS, LocalFrozenModel

    if reference == REFERENCE_SOLUTIONS:
        return ReferenceSolutions()
    if isinstance(reference, LocalFrozenModel):
        from composer_replication.model.loading import load_policy

        path = reference.local_path
        model, _ = load_policy(None if path == "embedded" else path)
        model.eval().requires_grad_(False)
        return InProcessSampler(model, live=False)
    return EndpointSampler(reference.base_url, reference.name, api_key_env=reference.api_key_env)
