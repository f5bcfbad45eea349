"""The policy sampler backed by an inference engine: token ids in, token ids out.

``EngineSampler`` is a :class:`~composer_replication.roles.Sampler` (of the live policy), so
environments and agents sample through it as through any other sampler. Prompts go out as lists of token ids in one
``/v1/completions`` request; completions come back as the engine's token ids
(``return_token_ids``) with the log-prob of each sampled token under the distribution it was
sampled from (the server runs with ``--logprobs-mode processed_logprobs``, i.e. after
temperature). Nothing is re-tokenised, so a multi-turn agent's stream is exactly what was
sampled. Each :class:`Generation` records the policy version that sampled it in
``metadata["policy_version"]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from composer_replication.inference.decoding.generate import Generation, SamplingSettings, announced

FINISH_REASONS = {"length": "length", "stop": "stop", "abort": "length"}


class EngineSampler:
    """Samples the policy through ``{base_url}/v1/completions``.

    Attributes:
        policy_version: the version of the weights the engine serves (0 = the weights it
            was started with); a weight sync raises it.
    """

    samples_from_live_policy = True

    def __init__(
        self,
        base_url: str,
        *,
        model: str = "policy",
        timeout_s: float = 600.0,
        seed: int | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self.seed = seed
        self.policy_version = 0
        self._requests = 0

    def sample_batch(
        self,
        tokenizer: Any,
        prompts: Sequence[Sequence[int]],
        settings: SamplingSettings,
        *,
        max_rows: int | None = None,
        on_row_done: Callable[[int, Generation], None] | None = None,
    ) -> list[Generation]:
        """One completion per prompt (all prompts in one request: the engine schedules
        the rows, ``max_rows`` does not apply); each announced once the request returns."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        eos = getattr(tokenizer, "eos_token_id", None)
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": [[int(t) for t in p] for p in prompts],
            "max_tokens": settings.max_new_tokens,
            "temperature": settings.temperature,
            "top_p": 1.0,
            "top_k": -1,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": True,
            "include_stop_str_in_output": True,
        }
        if settings.stop_strings:
            body["stop"] = list(settings.stop_strings)
        if self.seed is not None:  # distinct per request, reproducible per run
            body["seed"] = self.seed + self._requests
        self._requests += 1
        choices = sorted(self._post(body)["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts):
            raise RuntimeError(f"the engine returned {len(choices)} choices for {len(prompts)}")
        version = self.policy_version
        out = []
        for prompt, choice in zip(prompts, choices):
            ids = [int(t) for t in choice.get("token_ids") or ()]
            logprobs = [
                float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or ()
            ]
            if len(logprobs) != len(ids):
                raise RuntimeError(
                    f"the engine returned {len(ids)} token ids but {len(logprobs)} log-probs"
                )
            reason = FINISH_REASONS.get(choice.get("finish_reason"), "eos")
            if reason == "stop" and choice.get("stop_reason") is None and ids and ids[-1] == eos:
                reason = "eos"
            out.append(
                Generation(
                    prompt_ids=list(prompt),
                    completion_ids=ids,
                    logprobs=logprobs,
                    finish_reason=reason,
                    text=choice.get("text", ""),
                    metadata={"policy_version": version},
                )
            )
        return announced(out, on_row_done)

    def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
        """The engine's log-prob of each of ``completion_ids`` after ``prompt_ids``
        (temperature 1, the served weights), through ``prompt_logprobs``."""
        if not prompt_ids or not completion_ids:
            raise ValueError("score needs a non-empty prompt and completion")
        ids = [int(t) for t in (*prompt_ids, *completion_ids)]
        body = {
            "model": self.model,
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 0,
            "return_token_ids": True,
        }
        rows = self._post(body)["choices"][0]["prompt_logprobs"]
        out = []
        for position in range(len(prompt_ids), len(ids)):
            entry = rows[position] or {}
            token = str(ids[position])
            if token not in entry:
                raise RuntimeError(f"prompt_logprobs at {position} lacks token {token}: {entry}")
            out.append(float(entry[token]["logprob"]))
        return out

    def served_version(self) -> int:
        """The version every engine worker reports (asks the engine; -1 = never synced)."""
        import httpx

        body = {"method": "composer_policy_version_of", "args": [], "timeout": 60}
        with httpx.Client(timeout=60.0) as client:
            response = client.post(f"{self.base_url}/collective_rpc", json=body)
        response.raise_for_status()
        versions = {int(r["version"]) for r in response.json()["results"]}
        if len(versions) != 1:
            raise RuntimeError(f"engine workers serve different versions: {sorted(versions)}")
        return versions.pop()

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        import httpx

        url = f"{self.base_url}/v1/completions"
        with httpx.Client(timeout=self.timeout_s) as client:
            response = client.post(url, json=body)
        if response.status_code >= 400:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:2000]}")
        data = response.json()
        if not data.get("choices"):
            raise RuntimeError(f"{url} returned no choices: {str(data)[:500]}")
        return data
