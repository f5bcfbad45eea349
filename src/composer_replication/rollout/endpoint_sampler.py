"""Sampling from a frozen source: an OpenAI-compatible completions endpoint.

Used when an algorithm's ``sampling.source`` is a frozen endpoint (``sft`` distils a
teacher's samples). The prompt goes out as token ids (vLLM and llama.cpp servers accept a
list of ints as ``prompt``); the completion text comes back and is tokenised with the
policy's tokenizer. The endpoint's token log-probs are reported when the server returns
them, else 0.0 (a frozen source feeds only non-rl components, which do not read them).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from composer_replication.rollout.generate import Generation, SamplingSettings


class EndpointSampler:
    """A frozen sampling source behind ``{base_url}/completions``."""

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
        self, tokenizer: Any, prompts: Sequence[Sequence[int]], settings: SamplingSettings
    ) -> list[Generation]:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        out = []
        with httpx.Client(timeout=self.timeout_s, headers=headers) as client:
            for prompt in prompts:
                body = {
                    "model": self.model,
                    "prompt": list(prompt),
                    "max_tokens": settings.max_new_tokens,
                    "temperature": settings.temperature,
                    "logprobs": 0,
                }
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


def sampling_source(reference: Any, policy: Any) -> Any:
    """The model object to sample with for a ``sampling.source`` reference (for
    ``"reference"``, the marker that makes the environment answer with its reference
    solutions)."""
    if reference is None or reference == "policy":
        return policy
    from composer_replication.config.references import REFERENCE_SOLUTIONS

    if reference == REFERENCE_SOLUTIONS:
        from composer_replication.rollout.demonstrations import ReferenceSolutions

        return ReferenceSolutions()
    local_path = getattr(reference, "local_path", None)
    if local_path:
        from composer_replication.models import load_policy

        model, _ = load_policy(None if local_path == "embedded" else local_path)
        model.eval().requires_grad_(False)
        return model
    return EndpointSampler(
        reference.base_url, reference.name, api_key_env=getattr(reference, "api_key_env", None)
    )
