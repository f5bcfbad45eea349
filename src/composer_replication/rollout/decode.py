"""The in-process decode loop: prefill once per distinct prompt, then one token per step.

What it does that a general-purpose ``generate`` does not, and why it pays on a CPU:

- distinct prompts are prefilled once and their KV cache is copied to every row that
  shares them (a group samples ``group_size`` completions of one prompt);
- only the last position's logits are computed (no ``(rows, prompt, vocab)`` tensor);
- a row that has finished (EOS, stop string) leaves the batch at once, so the steps after
  it run on fewer rows and the loop ends when the last row finishes;
- no per-call set-up: stop strings are matched on the decoded text of each row's new
  tokens, not through a vocabulary-wide table built per call.

The distribution is unchanged: each step samples from ``softmax(logits / temperature)``
(float32 log-probs, inverse-CDF draw in float64 with one uniform per row from the global RNG:
:func:`sample_categorical`; ``temperature = 0``: argmax), and the
log-prob recorded for a token is ``log_softmax(logits / temperature)`` at that token (at
temperature 1 for greedy), which is what the trainer's importance ratio compares against.
Left padding, explicit position ids and the attention mask keep every row's computation
that of its own prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from composer_replication.rollout.generate import left_pad

__all__ = ["DecodedRow", "decode_rows", "sample_categorical"]


@dataclass(frozen=True)
class DecodedRow:
    """One row's sampled tokens, their log-probs, and why it stopped (eos|stop|length)."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str


class _StopMatcher:
    """Per row: the decoded text of the new tokens, checked for any stop string."""

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self.longest = max((len(s) for s in self.stop_strings), default=0)

    def hit(self, text: str, token: int) -> tuple[str, bool]:
        """``text`` extended by ``token``'s piece, and whether a stop string now ends in it."""
        piece = self.tokenizer.decode([token])
        text += piece
        # only a match that includes the new piece can be new
        window = text[-(self.longest + len(piece)) :]
        return text, any(s in window for s in self.stop_strings)


class _PreallocatedLayer:
    """A KV-cache layer that writes into buffers sized for the whole decode.

    The default cache grows by concatenation, copying the whole cache of every layer at
    every step; here each step writes its one new position in place and attention reads a
    view of the filled part.
    """

    @staticmethod
    def make(capacity: int) -> Any:
        from transformers.cache_utils import DynamicLayer

        class PreallocatedLayer(DynamicLayer):
            def lazy_initialization(self, key_states: torch.Tensor, value_states: Any) -> None:
                self.device = key_states.device
                rows, heads, _, dim = key_states.shape
                shape = (rows, heads, capacity, value_states.shape[-1])
                self._key_buffer = key_states.new_empty((rows, heads, capacity, dim))
                self._value_buffer = value_states.new_empty(shape)
                self.length = 0
                self.is_initialized = True

            def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
                if not self.is_initialized:
                    self.lazy_initialization(key_states, value_states)
                end = self.length + key_states.shape[-2]
                if end > capacity:
                    raise RuntimeError(f"KV cache capacity {capacity} exceeded ({end})")
                self._key_buffer[:, :, self.length : end] = key_states
                self._value_buffer[:, :, self.length : end] = value_states
                self.length = end
                self.keys = self._key_buffer[:, :, :end]
                self.values = self._value_buffer[:, :, :end]
                return self.keys, self.values

            def get_seq_length(self) -> int:
                return self.length if self.is_initialized else 0

            def batch_select_indices(self, indices: torch.Tensor) -> None:
                if self.is_initialized:
                    self._key_buffer = self._key_buffer[indices]
                    self._value_buffer = self._value_buffer[indices]
                    self.keys = self._key_buffer[:, :, : self.length]
                    self.values = self._value_buffer[:, :, : self.length]

        return PreallocatedLayer()


def _new_cache(model: Any, capacity: int) -> Any:
    """A cache of preallocated layers for ``model``, or the default one if its layer count
    is unknown."""
    from transformers import DynamicCache
    from transformers.cache_utils import Cache

    config = getattr(model, "config", None)
    text_config = config.get_text_config(decoder=True) if config is not None else None
    n_layers = getattr(text_config, "num_hidden_layers", None)
    if not isinstance(n_layers, int) or getattr(text_config, "sliding_window", None):
        return DynamicCache()
    return Cache(layers=[_PreallocatedLayer.make(capacity) for _ in range(n_layers)])


def _last_logits(model: Any, **inputs: Any) -> torch.Tensor:
    """(rows, vocab) float32 logits of the last position; the cache is updated in place."""
    out = model(**inputs, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :].float()


def sample_categorical(
    log_probs: torch.Tensor, generators: Sequence[torch.Generator] | None = None
) -> torch.Tensor:
    """One index per row drawn from ``softmax(log_probs)`` by inverting its CDF.

    Exact categorical sampling with one uniform number per row from the global RNG, or from
    each row's own host generator in ``generators`` (the vocabulary-wide exponential draw of
    ``torch.multinomial`` costs several milliseconds a step on a CPU). The CDF is
    accumulated in float64; a zero-probability token is never drawn.
    """
    cdf = log_probs.double().exp().cumsum(-1)
    if generators is None:
        u = torch.rand((cdf.shape[0], 1), dtype=torch.float64, device=cdf.device)
    else:
        if len(generators) != cdf.shape[0]:
            raise ValueError(f"{len(generators)} generators for {cdf.shape[0]} rows")
        draws = [torch.rand(1, dtype=torch.float64, generator=g) for g in generators]
        u = torch.stack(draws).to(cdf.device)
    u = u * cdf[:, -1:]
    index = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    return index.clamp_max(cdf.shape[-1] - 1)


def decode_rows(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    eos_ids: Sequence[int],
    pad_id: int,
    tokenizer: Any = None,
    stop_strings: Sequence[str] = (),
    row_seeds: Sequence[int] | None = None,
) -> list[DecodedRow]:
    """Sample one completion per prompt (see the module docstring); no grad, model as is.

    Each row ends at its first EOS (kept), at the token that completes a stop string
    (kept), or after ``max_new_tokens``. ``tokenizer`` is needed only with stop strings.
    ``row_seeds``: one seed per prompt, each row then draws from its own generator.
    """
    if stop_strings and tokenizer is None:
        raise ValueError("stop strings need the tokenizer to decode the sampled tokens")
    if row_seeds is not None and len(row_seeds) != len(prompts):
        raise ValueError(f"{len(row_seeds)} row seeds for {len(prompts)} prompts")
    generators = (
        None
        if row_seeds is None
        else [torch.Generator().manual_seed(int(seed)) for seed in row_seeds]
    )
    device = next(model.parameters()).device
    distinct: dict[tuple[int, ...], int] = {}
    row_prompt = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
    unique = list(distinct)
    ids, mask = left_pad(unique, pad_id, device=device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = _new_cache(model, ids.shape[1] + max_new_tokens)
    with torch.no_grad():
        logits = _last_logits(
            model, input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache
        )
        # every row starts from its prompt's prefill
        select = torch.as_tensor(row_prompt, dtype=torch.long, device=device)
        if len(unique) != len(prompts) or row_prompt != list(range(len(prompts))):
            cache.batch_select_indices(select)
        logits, mask = logits[select], mask[select]
        next_position = mask.sum(-1, keepdim=True)  # (rows, 1): each prompt's length

        greedy = temperature == 0
        scale = 1.0 if greedy else float(temperature)
        eos = torch.as_tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)
        matcher = _StopMatcher(tokenizer, stop_strings) if stop_strings else None
        active = list(range(len(prompts)))  # prompt index of each live batch row
        tokens: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        texts = [""] * len(prompts)
        reasons = ["length"] * len(prompts)
        for step in range(max_new_tokens):
            log_probs = torch.log_softmax(logits / scale, dim=-1)
            if greedy:
                picked = logits.argmax(-1)
            else:
                row_generators = None if generators is None else [generators[r] for r in active]
                picked = sample_categorical(log_probs, row_generators)
            picked_lp = log_probs.gather(-1, picked[:, None]).squeeze(-1)
            is_eos = torch.isin(picked, eos)
            keep: list[int] = []
            for batch_row, (row, tok, lp, ended) in enumerate(
                zip(active, picked.tolist(), picked_lp.tolist(), is_eos.tolist())
            ):
                tokens[row].append(tok)
                logprobs[row].append(lp)
                if ended:
                    reasons[row] = "eos"
                    continue
                if matcher is not None:
                    texts[row], stopped = matcher.hit(texts[row], tok)
                    if stopped:
                        reasons[row] = "stop"
                        continue
                keep.append(batch_row)
            if not keep or step == max_new_tokens - 1:
                break
            if len(keep) != len(active):  # finished rows leave the batch
                index = torch.as_tensor(keep, dtype=torch.long, device=device)
                cache.batch_select_indices(index)
                mask, next_position, picked = mask[index], next_position[index], picked[index]
                active = [active[i] for i in keep]
            mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=-1)
            logits = _last_logits(
                model,
                input_ids=picked[:, None],
                attention_mask=mask,
                position_ids=next_position,
                cache=cache,
            )
            next_position = next_position + 1
    return [DecodedRow(t, lp, r) for t, lp, r in zip(tokens, logprobs, reasons)]
