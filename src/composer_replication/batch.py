"""Build a valid input dict for :func:`composer_replication.loss.compose_loss`.

The batch has three parts, one per Composer channel. Keys (all ``torch.long`` unless noted;
sequences are right-padded with the tokenizer's pad id and masks are 0/1):

Channel 1, next-token CE on responses:
- ``input_ids`` (B, T): chat-formatted prompt followed by the response.
- ``attention_mask`` (B, T).
- ``response_mask`` (B, T): 1 on response tokens (the tokens the loss predicts).

Channel 2, SDPO self-distillation (present when at least one example has a hint):
- ``ctx_teacher_input_ids`` (B, T'): the same conversation with the hint added to the user
  turn, followed by the SAME response token ids (so positions align one to one).
- ``ctx_teacher_attention_mask`` (B, T').
- ``ctx_teacher_response_mask`` (B, T'): 1 on the response tokens of the teacher context;
  row b has exactly as many ones as ``response_mask[b]``.
- ``sdpo_loss_mask`` (B, T): the student response tokens that take the JSD (rows without
  a hint are all zero).

Channel 3, trace-replay DPO (present when pairs are given):
- ``dpo_chosen_input_ids`` / ``dpo_rejected_input_ids`` (P, T'').
- ``dpo_chosen_attention_mask`` / ``dpo_rejected_attention_mask`` (P, T'').
- ``dpo_chosen_response_mask`` / ``dpo_rejected_response_mask`` (P, T'').
- optional ``dpo_ref_chosen_logps`` / ``dpo_ref_rejected_logps`` (P,) float: summed
  response log-probs under the frozen reference; ``compose_loss`` fills them in once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SMOKE_SYSTEM_PROMPT = "You are a careful Python coding assistant. Answer with code only."


@dataclass(frozen=True)
class Example:
    """One supervised example: a prompt, its response, and an optional SDPO hint."""

    prompt: str
    response: str
    hint: str | None = None


@dataclass(frozen=True)
class PreferencePair:
    """One DPO pair: a prompt with a preferred and a dispreferred response."""

    prompt: str
    chosen: str
    rejected: str


DEFAULT_EXAMPLES: tuple[Example, ...] = (
    Example(
        prompt="Write a Python function `add(a, b)` that returns the sum of a and b.",
        response="def add(a, b):\n    return a + b\n",
        hint="A previous attempt failed `test_add_negative`: make sure negatives work too.",
    ),
    Example(
        prompt="Write a Python function `is_even(n)` that returns True when n is even.",
        response="def is_even(n):\n    return n % 2 == 0\n",
        hint=None,
    ),
)

DEFAULT_PAIRS: tuple[PreferencePair, ...] = (
    PreferencePair(
        prompt="Write a Python function `square(x)` that returns x squared.",
        chosen="def square(x):\n    return x * x\n",
        rejected="def square(x):\n    return x + x\n",
    ),
)


def build_batch(
    tokenizer: Any,
    *,
    examples: Sequence[Example] | None = None,
    pairs: Sequence[PreferencePair] | None = None,
    system_prompt: str = SMOKE_SYSTEM_PROMPT,
    max_length: int = 512,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Tokenise examples and preference pairs into a ``compose_loss`` input dict.

    Args:
        tokenizer: a Hugging Face tokenizer; its chat template is used when it has one.
        examples: supervised examples (default: two small coding examples, one with a hint).
        pairs: DPO pairs (default: one pair); pass ``()`` to leave channel 3 out.
        system_prompt: system message of every conversation.
        max_length: prompts are cut from the left so prompt + response fit; a response
            longer than this raises ``ValueError``.
        device: where the tensors are created.

    Returns:
        The dict documented in this module's docstring.
    """
    examples = tuple(DEFAULT_EXAMPLES if examples is None else examples)
    pairs = tuple(DEFAULT_PAIRS if pairs is None else pairs)
    if not examples:
        raise ValueError("examples is empty: channel 1 needs at least one example")
    if max_length < 8:
        raise ValueError(f"max_length={max_length} is too small; use at least 8 tokens")
    pad_id = _pad_id(tokenizer)

    batch: dict[str, torch.Tensor] = {}
    student = [
        _encode(tokenizer, system_prompt, ex.prompt, ex.response, max_length) for ex in examples
    ]
    batch.update(_pad_rows(student, pad_id, "", device))

    if any(ex.hint for ex in examples):
        teacher = []
        for ex, (_, response_ids) in zip(examples, student):
            hinted = f"{ex.prompt}\n\nHint: {ex.hint}" if ex.hint else ex.prompt
            teacher_prompt = _encode_prompt(tokenizer, system_prompt, hinted)
            teacher.append((_fit_prompt(teacher_prompt, response_ids, max_length), response_ids))
        batch.update(_pad_rows(teacher, pad_id, "ctx_teacher_", device))
        import torch

        has_hint = torch.tensor([bool(ex.hint) for ex in examples], device=device)
        batch["sdpo_loss_mask"] = batch["response_mask"] * has_hint[:, None].long()

    if pairs:
        chosen = [_encode(tokenizer, system_prompt, p.prompt, p.chosen, max_length) for p in pairs]
        rejected = [
            _encode(tokenizer, system_prompt, p.prompt, p.rejected, max_length) for p in pairs
        ]
        batch.update(_pad_rows(chosen, pad_id, "dpo_chosen_", device))
        batch.update(_pad_rows(rejected, pad_id, "dpo_rejected_", device))
    return batch


def _pad_id(tokenizer: Any) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    if pad is None:
        raise ValueError("tokenizer has neither a pad nor an eos token id; set tokenizer.pad_token")
    return int(pad)


def _encode_prompt(tokenizer: Any, system_prompt: str, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        messages = [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": prompt},
        ]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer versions
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(f"{system_prompt}\n\n{prompt}\n\n", add_special_tokens=True)["input_ids"])


def _encode_response(tokenizer: Any, response: str) -> list[int]:
    ids = list(tokenizer(response, add_special_tokens=False)["input_ids"])
    eos = getattr(tokenizer, "eos_token_id", None)
    return [*ids, int(eos)] if eos is not None else ids


def _fit_prompt(prompt_ids: list[int], response_ids: list[int], max_length: int) -> list[int]:
    room = max_length - len(response_ids)
    if room < 1:
        raise ValueError(
            f"a response of {len(response_ids)} tokens does not fit max_length={max_length}; "
            "raise max_length or shorten the response"
        )
    return prompt_ids[-room:]  # keep the end of the prompt: the question sits there


def _encode(
    tokenizer: Any, system_prompt: str, prompt: str, response: str, max_length: int
) -> tuple[list[int], list[int]]:
    # Prompt and response are tokenised apart and concatenated as ids, so the response
    # ids are identical in the student and the hinted teacher context.
    response_ids = _encode_response(tokenizer, response)
    prompt_ids = _fit_prompt(
        _encode_prompt(tokenizer, system_prompt, prompt), response_ids, max_length
    )
    return prompt_ids, response_ids


def _pad_rows(
    rows: Sequence[tuple[list[int], list[int]]], pad_id: int, prefix: str, device: Any
) -> dict[str, torch.Tensor]:
    import torch

    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    resp = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (prompt_ids, response_ids) in enumerate(rows):
        n_p, n_r = len(prompt_ids), len(response_ids)
        ids[i, : n_p + n_r] = torch.tensor(prompt_ids + response_ids)
        attn[i, : n_p + n_r] = 1
        resp[i, n_p : n_p + n_r] = 1
    return {
        f"{prefix}input_ids": ids.to(device),
        f"{prefix}attention_mask": attn.to(device),
        f"{prefix}response_mask": resp.to(device),
    }
