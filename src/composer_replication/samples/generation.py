"""What a sampler is asked and what it answers, for every kind of sampler: the sampling
settings of a call (temperature, length, stop strings) and one sampled completion with its
token ids and sampling log-probs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Generation", "SamplingSettings"]


@dataclass(frozen=True)
class SamplingSettings:
    """How to sample: ``temperature`` (0 = greedy), ``max_new_tokens``, ``stop_strings``;
    ``logprobs`` False: the caller reads no sampling log-probs (a frozen source's samples
    train only non-rl components), so a sampler may skip asking for them and report 0.0."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    stop_strings: tuple[str, ...] = ()
    logprobs: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")


@dataclass(frozen=True)
class Generation:
    """One sampled completion: token ids, their sampling log-probs, and why it stopped."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "eos" | "stop" | "length"
    text: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
