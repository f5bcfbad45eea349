"""Prefill scoring: log-probs a model assigns to given tokens of given sequences.

A ``PrefillScorer`` answers ``score(sequences, start)``: for each sequence, the log-probs
of ``tokens[start:]``, each given all tokens before it (teacher forcing, no generation).
This is how a frozen teacher grades the policy's samples (opd), how the policy grades a
sample behind a demonstration (opsd), and how DPO reference log-probs are computed.

- ``LocalPrefillScorer``: an in-process model, no grad, on the chunked hidden-state path
  (never materialises (B, T, V) logits); sequences batched with right padding.
- ``EndpointPrefillScorer``: an OpenAI-compatible server's completions endpoint, either
  vLLM's ``prompt_logprobs`` (``mode="vllm"``) or the classic ``echo`` + ``logprobs`` form
  (``mode="echo"``, llama.cpp / older OpenAI-style servers). Servers return log-probs at
  temperature 1; log-probs of the served model's own (possibly quantised) weights.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any, Literal, Protocol, runtime_checkable


@runtime_checkable
class PrefillScorer(Protocol):
    """``await score(sequences, start)`` -> per sequence, log-probs of ``tokens[start:]``."""

    async def score(self, sequences: list[list[int]], start: list[int]) -> list[list[float]]: ...


def _check_request(sequences: Sequence[Sequence[int]], start: Sequence[int]) -> None:
    if len(sequences) != len(start):
        raise ValueError(f"{len(sequences)} sequences but {len(start)} start positions")
    for i, (seq, s) in enumerate(zip(sequences, start)):
        if not 1 <= s <= len(seq):
            raise ValueError(
                f"sequence {i}: start={s} must be in [1, {len(seq)}] (token 0 has no log-prob)"
            )


class LocalPrefillScorer:
    """Prefill log-probs from an in-process Hugging Face causal LM (no grad).

    Args:
        model: the scoring model (a frozen teacher, or the live policy for opsd; scoring
            runs synchronously, so the policy is not being updated meanwhile).
        chunk_size: rows per chunk on the hidden-state path.
        temperature: log-probs of ``softmax(logits / temperature)``.
        batch_size: sequences per forward pass (right-padded to the longest).
    """

    def __init__(
        self,
        model: Any,
        *,
        chunk_size: int | None = None,
        temperature: float = 1.0,
        batch_size: int = 8,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.model = model
        self.chunk_size = chunk_size
        self.temperature = temperature
        self.batch_size = batch_size

    async def score(self, sequences: list[list[int]], start: list[int]) -> list[list[float]]:
        _check_request(sequences, start)
        out: list[list[float]] = []
        for i in range(0, len(sequences), self.batch_size):
            out.extend(
                self._score_batch(
                    sequences[i : i + self.batch_size], start[i : i + self.batch_size]
                )
            )
        return out

    def _score_batch(self, sequences: list[list[int]], start: list[int]) -> list[list[float]]:
        import torch

        from composer_replication.model.parts import last_hidden_states, lm_head_weight
        from composer_replication.ops.head import IGNORE_INDEX, token_logprobs_from_hidden

        width = max(len(s) for s in sequences)
        # built on the host, moved to the scoring model's device once
        host = {"dtype": torch.long, "device": "cpu"}
        ids = torch.zeros(len(sequences), width, **host)
        attn = torch.zeros(len(sequences), width, **host)
        targets = torch.full((len(sequences), width - 1), IGNORE_INDEX, **host)
        for b, (seq, s) in enumerate(zip(sequences, start)):
            ids[b, : len(seq)] = torch.tensor(seq, **host)
            attn[b, : len(seq)] = 1
            targets[b, s - 1 : len(seq) - 1] = ids[b, s : len(seq)]
        device = lm_head_weight(self.model).device
        ids, attn, targets = ids.to(device), attn.to(device), targets.to(device)
        with torch.no_grad():
            hidden = last_hidden_states(self.model, ids, attn)
            logprobs = token_logprobs_from_hidden(
                hidden[:, :-1],
                lm_head_weight(self.model),
                targets,
                temperature=self.temperature,
                chunk_size=self.chunk_size,
            )
        return [
            logprobs[b, s - 1 : len(seq) - 1].tolist()
            for b, (seq, s) in enumerate(zip(sequences, start))
        ]


class EndpointPrefillScorer:
    """Prefill log-probs from an OpenAI-compatible completions endpoint (httpx, async).

    ``mode="vllm"`` posts ``{"model", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}``
    and reads ``choices[0].prompt_logprobs`` (a list, ``None`` first, then per token a dict
    ``token_id -> {"logprob": ...}``). ``mode="echo"`` posts ``{"model", "prompt": ids,
    "echo": true, "logprobs": 0, "max_tokens": 0}`` and reads
    ``choices[0].logprobs.token_logprobs``. Transport errors, 429 and 5xx are retried
    ``max_retries`` times with exponential backoff; other statuses raise at once.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key_env: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        mode: Literal["vllm", "echo"] = "vllm",
        max_concurrency: int = 8,
        backoff_s: float = 0.5,
    ) -> None:
        if mode not in ("vllm", "echo"):
            raise ValueError(f"mode={mode!r} must be 'vllm' or 'echo'")
        self.api_key: str | None = None
        if api_key_env is not None:
            self.api_key = os.environ.get(api_key_env)
            if not self.api_key:
                raise RuntimeError(
                    f"environment variable {api_key_env} (the API key of {base_url}) is not set"
                )
        self.url = base_url.rstrip("/") + "/completions"
        self.model = model
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.mode = mode
        self.max_concurrency = max_concurrency
        self.backoff_s = backoff_s

    def _payload(self, ids: list[int]) -> dict[str, Any]:
        if self.mode == "vllm":
            return {"model": self.model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}
        return {"model": self.model, "prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0}

    def _parse(self, body: dict[str, Any], ids: list[int]) -> list[float | None]:
        choice = body["choices"][0]
        if self.mode == "echo":
            values = list(choice["logprobs"]["token_logprobs"])
        else:
            values = []
            for tok, entry in zip(ids, choice["prompt_logprobs"]):
                if entry is None:
                    values.append(None)
                    continue
                hit = entry.get(str(tok), entry.get(tok))  # JSON keys are strings
                if hit is None:
                    raise ValueError(f"{self.url}: no log-prob for prompt token {tok}")
                values.append(hit["logprob"] if isinstance(hit, dict) else float(hit))
        if len(values) < len(ids):
            raise ValueError(
                f"{self.url} returned {len(values)} prompt log-probs for {len(ids)} tokens"
            )
        return values[: len(ids)]

    async def _one(self, client: Any, ids: list[int], start: int, gate: asyncio.Semaphore):
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with gate:
            for attempt in range(self.max_retries + 1):
                try:
                    response = await client.post(self.url, json=self._payload(ids), headers=headers)
                    retryable = response.status_code == 429 or response.status_code >= 500
                    if not retryable:
                        response.raise_for_status()
                        values = self._parse(response.json(), ids)
                        return [float(v) for v in values[start:]]
                    error: Exception = RuntimeError(
                        f"{self.url} answered {response.status_code}: {response.text[:200]}"
                    )
                except httpx.TransportError as exc:
                    error = exc
                if attempt < self.max_retries:
                    await asyncio.sleep(self.backoff_s * 2**attempt)
        raise RuntimeError(
            f"prefill scoring at {self.url} failed after {self.max_retries + 1} attempts: {error}"
        )

    async def score(self, sequences: list[list[int]], start: list[int]) -> list[list[float]]:
        import httpx

        _check_request(sequences, start)
        gate = asyncio.Semaphore(self.max_concurrency)
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            return list(
                await asyncio.gather(
                    *(self._one(client, list(s), st, gate) for s, st in zip(sequences, start))
                )
            )


def scorer_for(reference: Any) -> PrefillScorer | None:
    """A scorer serving a frozen reference from the config; None for ``"policy"``.

    A ``FrozenEndpoint`` becomes an ``EndpointPrefillScorer`` (vLLM mode); a
    ``LocalFrozenModel`` is loaded with ``model.loading.load_policy`` into a ``LocalPrefillScorer``.
    """
    from composer_replication.config.references import FrozenEndpoint, LocalFrozenModel

    if isinstance(reference, FrozenEndpoint):
        return EndpointPrefillScorer(
            reference.base_url, reference.name, api_key_env=reference.api_key_env
        )
    if isinstance(reference, LocalFrozenModel):
        from composer_replication.model.loading import load_policy

        model, _ = load_policy(reference.local_path)
        return LocalPrefillScorer(model)
    return None
