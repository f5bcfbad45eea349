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
from dataclasses import dataclass
from typing import Any

from composer_replication.hint_generator import classify_error, dispatch
from composer_replication.samples.rollouts import Rollout

_QUOTE_LINES, _QUOTE_CHARS = 8, 800


def render_prompt(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
) -> list[int]:
    """Chat-template token ids of ``messages`` followed by the assistant generation prompt
    (``tools``: the JSON schemas a template with tool calls of its own was given)."""
    extra = {"tools": list(tools)} if tools else {}
    ids = tokenizer.apply_chat_template(
        list(messages), tokenize=True, add_generation_prompt=True, **extra
    )
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
    return hint_for((rollout.feedback or rollout.error or ""), source)


def hint_for(error: str, source: str) -> str | None:
    """The hint for an error text, as :func:`hint_text` words it (None for 'none')."""
    if source == "none":
        return None
    text = error.strip()
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


#: tools whose call changes the repository (a failing test run after one blames it)
EDIT_TOOLS = frozenset({"replace", "replace_function", "create_file", "write_file", "shell"})


@dataclass(frozen=True)
class TurnSite:
    """An error site at one turn of a multi-turn rollout: the turn (0-based trajectory
    step) whose reply a hint is about, and the error text the hint is made from."""

    step: int
    error: str


def turn_sites(rollout: Rollout) -> list[TurnSite]:
    """The turns of an agent episode where a call failed, one site per turn, in order:

    - a reply that was no readable call (``parse_error``) or a call that failed
      (``tool_error``, ``sandbox_error``): that turn, with the error it got back;
    - a test run that failed (``run_tests`` whose ``info`` counts failures or errors): the
      last turn before it that changed the repository (``EDIT_TOOLS``; the run's own turn
      when none did), with the run's output.

    Events carry their 1-based turn (``rollout.agent``); the output of a test run is the
    observation that followed it in ``metadata["conversation"]``.
    """
    events = rollout.metadata.get("events") or ()
    conversation = rollout.metadata.get("conversation") or ()
    observations = _observations(conversation)
    sites: dict[int, str] = {}
    last_edit: int | None = None
    for event in events:
        turn, kind = int(event.get("turn", 0)), event.get("type")
        if turn < 1:
            continue
        if kind in ("parse_error", "tool_error", "sandbox_error"):
            sites.setdefault(turn, str(event.get("message") or ""))
        elif kind == "tool_call" and event.get("name") in EDIT_TOOLS:
            last_edit = turn
        elif kind == "tool_call" and event.get("name") == "run_tests":
            info = event.get("info") or {}
            if int(info.get("failed", 0)) + int(info.get("errors", 0)) > 0:
                sites.setdefault(last_edit or turn, observations.get(turn, ""))
    return [TurnSite(turn - 1, text) for turn, text in sorted(sites.items())]


def turn_rewards(rollout: Rollout) -> list[float]:
    """Per trajectory step of an agent episode, its share of the test progress: a test run
    (``run_tests`` with ``info`` counting ``target_passed`` of ``n_targets``) measures the
    share of target tests passing; its change since the previous run (0 before the first)
    is split over the turns that changed the repository in between (``EDIT_TOOLS``). Zero
    for every other turn, and for an episode with no such runs."""
    n_steps = len(rollout.trajectory)
    rewards = [0.0] * n_steps
    previous, edits = 0.0, []
    for event in rollout.metadata.get("events") or ():
        kind, name, turn = event.get("type"), event.get("name"), int(event.get("turn", 0))
        if kind == "tool_call" and name in EDIT_TOOLS:
            edits.append(turn - 1)
        elif kind in ("tool_call", "tool_error") and name == "run_tests":
            info = event.get("info") or {}
            if not info.get("n_targets"):
                continue
            share = float(info.get("target_passed", 0)) / float(info["n_targets"])
            for step in edits:
                if 0 <= step < n_steps:
                    rewards[step] += (share - previous) / len(edits)
            previous, edits = share, []
    return rewards


def _observations(conversation: Sequence[dict[str, Any]]) -> dict[int, str]:
    """Turn (1-based) -> the text of the observation that answered it."""
    out, turn = {}, 0
    for message in conversation:
        if message.get("role") == "assistant":
            turn += 1
        elif turn:
            out.setdefault(turn, str(message.get("content") or ""))
    return out


def last_edit_step(rollout: Rollout) -> int:
    """The 0-based step of the last turn that changed the repository (the last turn when
    none did)."""
    edits = [
        int(e["turn"]) - 1
        for e in rollout.metadata.get("events") or ()
        if e.get("type") == "tool_call" and e.get("name") in EDIT_TOOLS
    ]
    return edits[-1] if edits else max(0, int(rollout.metadata.get("turns", 1)) - 1)


def augment_last(
    messages: Sequence[dict[str, Any]], template: str, **fields: str
) -> list[dict[str, Any]]:
    """A copy of ``messages`` whose last message that is not the assistant's is rewritten
    by ``template`` (an observation, or the user's prompt)."""
    out = [dict(m) for m in messages]
    for message in reversed(out):
        if message.get("role") != "assistant":
            message["content"] = template.format(content=message.get("content") or "", **fields)
            return out
    out.append({"role": "user", "content": template.format(content="", **fields).lstrip()})
    return out


def turn_teacher_context(
    tokenizer: Any, rollout: Rollout, step: int, template: str, **fields: str
) -> tuple[list[int], list[int], int]:
    """(teacher_input_ids, teacher_index, sample_length) for the sampled tokens of turn
    ``step`` (0-based) of a multi-turn rollout: the conversation before that turn, its last
    observation rewritten by ``template`` (the hint about that turn's error), rendered with
    the generation prompt, then the SAME sampled ids of the turn. ``teacher_index`` maps
    the positions of the sample (the rollout cut after that turn's sampled tokens,
    ``sample_length`` long) to the teacher's, -1 elsewhere."""
    steps = rollout.trajectory
    if not 0 <= step < len(steps):
        raise ValueError(f"rollout {rollout.task_id!r} has {len(steps)} turns, not {step + 1}")
    conversation = rollout.metadata.get("conversation")
    if not conversation:
        raise ValueError(
            f"rollout {rollout.task_id!r} has no conversation: a turn's teacher context needs "
            "the messages before that turn (metadata['conversation'], as the agent loop keeps)"
        )
    assistant = [i for i, m in enumerate(conversation) if m.get("role") == "assistant"]
    before = list(conversation[: assistant[step]]) if step < len(assistant) else list(conversation)
    prefix = render_prompt(
        tokenizer, augment_last(before, template, **fields), rollout.prompt_tools
    )
    turn = steps[step]
    n_sampled = next(
        (j for j, m in enumerate(turn.completion_mask) if not m), len(turn.completion_mask)
    )
    start = len(rollout.prompt_ids) + turn.start
    ids = [*prefix, *turn.completion_ids[:n_sampled]]
    index = [-1] * start + [len(prefix) + j for j in range(n_sampled)]
    return ids, index, start + n_sampled


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
    prefix = render_prompt(
        tokenizer,
        augment_messages(rollout.prompt_messages, template, **fields),
        rollout.prompt_tools,
    )
    ids = [*prefix, *rollout.completion_ids]
    index = [-1] * len(rollout.prompt_ids) + [
        len(prefix) + j for j in range(len(rollout.completion_ids))
    ]
    return ids, index
