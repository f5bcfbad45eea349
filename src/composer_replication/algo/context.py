"""Teacher contexts: a rollout's prompt re-rendered with a hint or a demonstration.

Self-distillation (SDPO, OPSD) compares the policy on the plain prompt with a teacher on a
richer one. The richer prompt is the rollout's ``prompt_messages`` with the last user
message rewritten by a template, rendered with the tokenizer's chat template, and followed
by the SAME completion token ids, so every completion token has a twin in the teacher
context (``teacher_index``). Tokens are never re-tokenised: alignment is exact by
construction.

Error sites and their notes:
- a rollout with ``feedback`` (or ``error``), or with a reward below the group's best, is
  an error site;
- its note is a demonstration (a better sibling's completion, or the task's reference
  solution, ``rollout.reference``) when one exists and demos are enabled,
  else a hint: ``hint_generator.classify_error`` + ``dispatch`` on the
  feedback, falling back to a generic hint that quotes the feedback's tail.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from composer_replication.hint_generator import classify_error, dispatch
from composer_replication.rollout.types import Rollout

_QUOTE_LINES, _QUOTE_CHARS = 8, 800


def render_prompt(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> list[int]:
    """Chat-template token ids of ``messages`` followed by the assistant generation prompt."""
    ids = tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True)
    if hasattr(ids, "keys"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def augment_messages(
    messages: Sequence[dict[str, Any]], template: str, **fields: str
) -> list[dict[str, Any]]:
    """A copy of ``messages`` whose last user message is ``template.format(content=..., **)``.

    With no user message, the formatted template (``content`` = "") is appended as one.
    """
    out = [dict(m) for m in messages]
    for message in reversed(out):
        if message.get("role") == "user":
            message["content"] = template.format(content=message.get("content") or "", **fields)
            return out
    out.append({"role": "user", "content": template.format(content="", **fields).lstrip()})
    return out


def _tail(text: str) -> str:
    lines = text.rstrip().splitlines()[-_QUOTE_LINES:]
    return "\n".join(lines)[-_QUOTE_CHARS:]


def hint_text(rollout: Rollout, source: str) -> str | None:
    """The hint for an error site, or None when ``source`` is 'none'.

    ``generator``: the ``hint_generator`` template for ``classify_error(feedback)``;
    ``feedback``: the feedback itself. Both fall back to a generic hint that quotes the
    tail of the feedback (or says only that the attempt failed, when there is none).
    """
    if source == "none":
        return None
    text = (rollout.feedback or rollout.error or "").strip()
    if source == "generator" and text:
        kind = classify_error(text)
        hint = dispatch(kind, {"error_message": text}) if kind else None
        if hint:
            return hint
    if source == "feedback" and text:
        return text
    if text:
        return f"Your previous attempt failed with:\n{_tail(text)}\nFind the cause and fix it."
    return (
        "A previous attempt at this task did not pass the tests. Re-read the task, check the "
        "edge cases, and fix the cause."
    )


def demonstration_text(tokenizer: Any, rollout: Rollout) -> str:
    """A rollout's completion as text, special tokens dropped (the demonstration)."""
    return tokenizer.decode(rollout.completion_ids, skip_special_tokens=True).strip()


def better_sibling(group: Sequence[Rollout], i: int) -> Rollout | None:
    """The first rollout of the group with the group's best reward, if it beats rollout i."""
    best = max(r.reward for r in group)
    if group[i].reward >= best:
        return None
    return next(r for j, r in enumerate(group) if j != i and r.reward == best)


def is_error_site(group: Sequence[Rollout], i: int) -> bool:
    """Rollout i has feedback / an error, or a reward below the group's best."""
    rollout = group[i]
    if rollout.feedback or rollout.error:
        return True
    return rollout.reward < max(r.reward for r in group)


def teacher_context(
    tokenizer: Any, rollout: Rollout, template: str, **fields: str
) -> tuple[list[int], list[int]]:
    """(teacher_input_ids, teacher_index) for the rollout's prompt rewritten by ``template``.

    ``teacher_input_ids`` = rendered augmented prompt + the rollout's completion ids;
    ``teacher_index[p]`` is the teacher position of sample token p (prompt + completion),
    -1 on the prompt.
    """
    if not rollout.prompt_messages:
        raise ValueError(
            f"rollout {rollout.task_id!r} has no prompt_messages: a teacher context needs the "
            "chat messages behind prompt_ids to re-render them with a hint or demonstration; "
            "have the environment record them on the Rollout"
        )
    prefix = render_prompt(tokenizer, augment_messages(rollout.prompt_messages, template, **fields))
    ids = [*prefix, *rollout.completion_ids]
    index = [-1] * len(rollout.prompt_ids) + [
        len(prefix) + j for j in range(len(rollout.completion_ids))
    ]
    return ids, index
