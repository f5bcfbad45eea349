"""Build a valid input dict for :func:`composer_replication.loss.compose_loss`.

The batch has three parts, one per Composer channel. Keys (all ``torch.long`` unless noted;
masks are 0/1):

Channel 1, next-token CE on responses:
- ``input_ids`` (B, T): chat-formatted prompt followed by the response.
- ``attention_mask`` (B, T).
- ``response_mask`` (B, T): 1 on response tokens (the tokens the loss predicts).

Channel 2, SDPO self-distillation (present when at least one example has a hint):
- ``ctx_teacher_input_ids`` (B, T'): the same conversation with each site's hint written in
  (the user turn, or the failing tool result before a site turn), followed by the SAME
  response token ids (so positions align one to one).
- ``ctx_teacher_attention_mask`` (B, T').
- ``ctx_teacher_response_mask`` (B, T'): 1 on the response tokens of the teacher context;
  row b has exactly as many ones as ``response_mask[b]``.
- ``sdpo_loss_mask`` (B, T'): the teacher-context response tokens that take the divergence
  (rows without a hint are all zero). ``compose_loss`` also accepts it in the student's
  shape (B, T), as ``ComposerDataCollator`` writes it.

With ``align_sdpo_shapes=True`` the prompts are left-padded so that student and teacher
rows have one width and every response token sits in the SAME column of both contexts:
then ``sdpo_loss_mask`` (B, T) fits both.

Channel 3, trace-replay DPO (present when pairs are given):
- ``dpo_chosen_input_ids`` / ``dpo_rejected_input_ids`` (P, T'').
- ``dpo_chosen_attention_mask`` / ``dpo_rejected_attention_mask`` (P, T'').
- ``dpo_chosen_response_mask`` / ``dpo_rejected_response_mask`` (P, T'').
- ``dpo_chosen_ref_logprobs`` / ``dpo_rejected_ref_logprobs`` (P, T'') float: per-token
  reference log-probs (position t holds log p(token t | tokens < t); 0 off the response).
  With ``ref_model`` they are that model's; without one they are seeded stand-ins (the
  verification-harness behaviour: log-probs drawn with ``seed``), so the batch is complete
  for any model; ``ref_model`` gives the real ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from composer_replication.samples.padding import pad_id_of, pad_rows

if TYPE_CHECKING:
    import torch

SMOKE_SYSTEM_PROMPT = "You are a careful Python coding assistant. Answer with code only."
VARIANTS = ("factorial", "binary_search")


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


_FACTORIAL_EXAMPLES = (
    Example(
        prompt="Write a Python function `factorial(n)` that returns n! for n >= 0.",
        response=(
            "def factorial(n):\n    result = 1\n    for k in range(2, n + 1):\n"
            "        result *= k\n    return result\n"
        ),
        hint="A previous attempt failed `test_factorial_zero`: factorial(0) must be 1.",
    ),
    Example(
        prompt="Write a Python function `is_even(n)` that returns True when n is even.",
        response="def is_even(n):\n    return n % 2 == 0\n",
        hint=None,
    ),
)
_FACTORIAL_PAIRS = (
    PreferencePair(
        prompt="Write a Python function `factorial(n)` that returns n! for n >= 0.",
        chosen="def factorial(n):\n    return 1 if n < 2 else n * factorial(n - 1)\n",
        rejected="def factorial(n):\n    return n * factorial(n - 1)\n",
    ),
)
_BINARY_SEARCH_EXAMPLES = (
    Example(
        prompt=(
            "Write a Python function `binary_search(items, target)` that returns the index "
            "of target in the sorted list items, or -1."
        ),
        response=(
            "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n"
            "    while lo <= hi:\n        mid = (lo + hi) // 2\n"
            "        if items[mid] == target:\n            return mid\n"
            "        if items[mid] < target:\n            lo = mid + 1\n"
            "        else:\n            hi = mid - 1\n    return -1\n"
        ),
        hint="A previous attempt looped forever on `test_missing_target`: move lo or hi past mid.",
    ),
    Example(
        prompt="Write a Python function `clamp(x, lo, hi)` that limits x to [lo, hi].",
        response="def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n",
        hint=None,
    ),
)
_BINARY_SEARCH_PAIRS = (
    PreferencePair(
        prompt=(
            "Write a Python function `binary_search(items, target)` that returns the index "
            "of target in the sorted list items, or -1."
        ),
        chosen=(
            "def binary_search(items, target):\n    lo, hi = 0, len(items)\n"
            "    while lo < hi:\n        mid = (lo + hi) // 2\n"
            "        if items[mid] < target:\n            lo = mid + 1\n"
            "        else:\n            hi = mid\n"
            "    return lo if lo < len(items) and items[lo] == target else -1\n"
        ),
        rejected=(
            "def binary_search(items, target):\n    for i in range(len(items)):\n"
            "        if items[i] == target:\n            return i\n"
        ),
    ),
)
_VARIANT_DATA = {
    "factorial": (_FACTORIAL_EXAMPLES, _FACTORIAL_PAIRS),
    "binary_search": (_BINARY_SEARCH_EXAMPLES, _BINARY_SEARCH_PAIRS),
}
DEFAULT_EXAMPLES: tuple[Example, ...] = _FACTORIAL_EXAMPLES
DEFAULT_PAIRS: tuple[PreferencePair, ...] = _FACTORIAL_PAIRS


def build_batch(
    tokenizer: Any,
    *,
    device: str | torch.device = "cpu",
    seed: int = 42,
    variant: str = "factorial",
    align_sdpo_shapes: bool = False,
    ref_model: Any | None = None,
    examples: Sequence[Example] | None = None,
    pairs: Sequence[PreferencePair] | None = None,
    system_prompt: str = SMOKE_SYSTEM_PROMPT,
    max_length: int = 512,
) -> dict[str, torch.Tensor]:
    """Tokenise examples and preference pairs into a ``compose_loss`` input dict.

    Args:
        tokenizer: a Hugging Face tokenizer; its chat template is used when it has one.
        device: where the tensors are created.
        seed: seeds the stand-in reference log-probs (used only without ``ref_model``).
        variant: the built-in task, ``"factorial"`` or ``"binary_search"``: two examples
            (one with a hint) and one preference pair.
        align_sdpo_shapes: left-pad prompts so student and teacher rows share one width with
            the response in the same columns (``sdpo_loss_mask`` then fits both).
        ref_model: frozen model whose per-token log-probs become the DPO reference.
        examples: supervised examples, replacing the variant's.
        pairs: DPO pairs, replacing the variant's; ``()`` leaves channel 3 out.
        system_prompt: system message of every conversation.
        max_length: prompts are cut from the left so prompt + response fit; a response
            longer than this raises ``ValueError``.

    Returns:
        The dict documented in this module's docstring.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not one of {VARIANTS}")
    default_examples, default_pairs = _VARIANT_DATA[variant]
    examples = tuple(default_examples if examples is None else examples)
    pairs = tuple(default_pairs if pairs is None else pairs)
    if not examples:
        raise ValueError("examples is empty: channel 1 needs at least one example")
    if max_length < 8:
        raise ValueError(f"max_length={max_length} is too small; use at least 8 tokens")
    import torch

    pad_id = pad_id_of(tokenizer)
    batch: dict[str, torch.Tensor] = {}
    student = [
        _encode(tokenizer, system_prompt, ex.prompt, ex.response, max_length) for ex in examples
    ]
    teacher = None
    if any(ex.hint for ex in examples):
        teacher = []
        for ex, (_, response_ids) in zip(examples, student):
            hinted = f"{ex.prompt}\n\nHint: {ex.hint}" if ex.hint else ex.prompt
            teacher_prompt = _encode_prompt(tokenizer, system_prompt, hinted)
            teacher.append((_fit_prompt(teacher_prompt, response_ids, max_length), response_ids))
    prompt_width = None
    if align_sdpo_shapes and teacher is not None:
        prompt_width = max(len(p) for p, _ in (*student, *teacher))
    batch.update(_pad_rows(student, pad_id, "", device, prompt_width))
    if teacher is not None:
        batch.update(_pad_rows(teacher, pad_id, "ctx_teacher_", device, prompt_width))
        has_hint = torch.tensor([bool(ex.hint) for ex in examples], device=device)
        batch["sdpo_loss_mask"] = batch["ctx_teacher_response_mask"] * has_hint[:, None].long()

    if pairs:
        for side in ("chosen", "rejected"):
            rows = [
                _encode(tokenizer, system_prompt, p.prompt, getattr(p, side), max_length)
                for p in pairs
            ]
            batch.update(_pad_rows(rows, pad_id, f"dpo_{side}_", device, None))
        batch.update(_reference_logprobs(batch, ref_model, seed))
    return batch


def _reference_logprobs(batch: dict[str, Any], ref_model: Any | None, seed: int) -> dict[str, Any]:
    """Per-token reference log-probs of both pair sides (real with a model, else seeded)."""
    import torch

    out = {}
    generator = torch.Generator().manual_seed(int(seed))
    for side in ("chosen", "rejected"):
        ids = batch[f"dpo_{side}_input_ids"]
        response = batch[f"dpo_{side}_response_mask"].clone()
        response[:, 0] = 0  # the first token has no log-prob
        if ref_model is not None:
            from composer_replication.model.parts import last_hidden_states, lm_head_weight
            from composer_replication.ops.head import token_logprobs_from_hidden

            with torch.no_grad():
                hidden = last_hidden_states(ref_model, ids, batch[f"dpo_{side}_attention_mask"])
                targets = ids[:, 1:].masked_fill(response[:, 1:] == 0, -100)
                logprobs = token_logprobs_from_hidden(
                    hidden[:, :-1], lm_head_weight(ref_model), targets
                )
            values = torch.cat([logprobs.new_zeros(ids.shape[0], 1), logprobs], dim=1)
        else:
            # Stand-ins: log of probabilities drawn uniformly in [0.05, 1).
            u = torch.rand(ids.shape, generator=generator) * 0.95 + 0.05
            values = u.log().to(ids.device)
        out[f"dpo_{side}_ref_logprobs"] = values * response.to(values.dtype)
    return out


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
    rows: Sequence[tuple[list[int], list[int]]],
    pad_id: int,
    prefix: str,
    device: Any,
    prompt_width: int | None,
) -> dict[str, torch.Tensor]:
    """(prompt, response) rows as (N, W) tensors: right-padded, or with prompts left-padded
    to ``prompt_width`` (responses then start in one column) when it is given."""
    import torch

    if prompt_width is None:
        ids, attn = pad_rows([p + r for p, r in rows], pad_id)
        resp, _ = pad_rows([[0] * len(p) + [1] * len(r) for p, r in rows])
    else:
        prompt_ids, prompt_attn = pad_rows(
            [p for p, _ in rows], pad_id, left=True, width=prompt_width
        )
        response_ids, response_attn = pad_rows([r for _, r in rows], pad_id)
        ids = torch.cat([prompt_ids, response_ids], dim=1)
        attn = torch.cat([prompt_attn, response_attn], dim=1)
        resp = torch.cat([torch.zeros_like(prompt_attn), response_attn], dim=1)
    return {
        f"{prefix}input_ids": ids.to(device),
        f"{prefix}attention_mask": attn.to(device),
        f"{prefix}response_mask": resp.to(device),
    }
