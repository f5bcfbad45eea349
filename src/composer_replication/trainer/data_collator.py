"""Agent-trace examples -> the padded batch dict of ``loss.compose_loss``.

A ``TraceExample`` is one decision of an agent: the conversation so far (``turns``), the
action taken (``response``), its rewards, optionally the error it ran into and teacher
preference pairs for the same state. ``ComposerDataCollator(tokenizer, config)(examples)``
builds the three channels' inputs (the key layout of :mod:`composer_replication.batch`).
Examples may also be given as trace dicts (:meth:`TraceExample.from_dict`): ``trace_id``,
``turns`` (``role`` / ``content`` messages; assistant ``tool_calls``; tool ``name`` and
``is_error`` / ``error``), ``final_reward`` and ``dpo_pairs`` (``chosen`` / ``rejected``);
the last assistant turn is the response trained on, the turns before it are the state.

- always: ``input_ids``, ``attention_mask``, ``response_mask`` (B, T), ``labels`` (B, T)
  (``input_ids`` with ``ignore_index`` off the response) and ``rewards`` (B,) float, read
  from ``example.rewards[config.rlvr_reward_key]``;
- SDPO, when ``enable_sdpo``, a ``hint_generator`` is configured and some example has an
  error site: ``ctx_teacher_input_ids``, ``ctx_teacher_attention_mask``,
  ``ctx_teacher_response_mask`` (B, T') and ``sdpo_loss_mask`` (B, T). The teacher context is
  the state with the hint added to the last user message (``algo.context.augment_messages``),
  followed by the SAME response token ids; rows without a hint keep the plain state and an
  all-zero ``sdpo_loss_mask`` row;
- replay DPO, when ``enable_replay_dpo`` and some example carries pairs:
  ``dpo_{chosen,rejected}_{input_ids,attention_mask,response_mask}`` (P, T''), one row per
  pair (state + that response).

Truncation: a prompt is cut from the left (the latest turns are kept), a response from the
right, so that every row fits ``max_seq_len`` (``max_dpo_seq_len`` for pairs) with at least
one prompt token before the response. The response is tokenised once (text + eos) and the
same ids are appended to every context, so student and teacher positions align exactly.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from composer_replication.algo.context import augment_messages, render_prompt
from composer_replication.config.advantage import DEFAULT_HINT_TEMPLATE
from composer_replication.hint_generator import HintContext, classify_error
from composer_replication.safety.holdout import DEFAULT_SPLIT, HeldoutSplit

__all__ = [
    "CollatorConfig",
    "ComposerDataCollator",
    "TokenizerLike",
    "TraceExample",
    "TraceTurn",
]

ROLES = ("system", "user", "assistant", "tool")
_OBSERVATION_ROLES = ("user", "tool")


@runtime_checkable
class TokenizerLike(Protocol):
    """What the collator needs from a tokenizer (a Hugging Face tokenizer fits)."""

    eos_token_id: int | None

    def __call__(self, text: str, *, add_special_tokens: bool = ...) -> Mapping[str, Any]: ...

    def apply_chat_template(
        self, conversation: list[dict[str, Any]], *, tokenize: bool, add_generation_prompt: bool
    ) -> Any: ...


@dataclass(frozen=True)
class TraceTurn:
    """One message of a trace. ``error`` marks an observation that reports a failure (a
    tool error, failing tests); ``tool_name`` is the tool that produced it."""

    role: str
    content: str
    tool_name: str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"TraceTurn role {self.role!r} is not one of {ROLES}")

    def message(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class TraceExample:
    """One agent decision: ``turns`` (the state), ``response`` (the action trained on).

    Attributes:
        turns: the conversation before the response (at least one turn).
        response: the assistant text that was produced at this state.
        rewards: named scalar rewards; ``CollatorConfig.rlvr_reward_key`` is the one used.
        error: the failure the response led to (failing tests, tool error); the error site
            SDPO hints about. Without it, an ``error`` on the last observation turn counts.
        error_kind: a ``hint_generator.HINT_TEMPLATES`` key (default: ``classify_error``).
        chosen / rejected: a teacher preference pair for the same state (both or neither).
        available_tools: tool names offered to the agent (for tool hints).
        state_id: free-form id, reported in errors.
        more_pairs: further ``(chosen, rejected)`` pairs for the same state.
        task_id: the environment task the trace worked on, when known: a held-out task is
            refused by the collator (``CollatorConfig.split``).
    """

    turns: tuple[TraceTurn, ...]
    response: str
    rewards: Mapping[str, float] = field(default_factory=dict)
    error: str | None = None
    error_kind: str | None = None
    chosen: str | None = None
    rejected: str | None = None
    available_tools: tuple[str, ...] = ()
    state_id: str = ""
    more_pairs: tuple[tuple[str, str], ...] = ()
    task_id: str | None = None

    def __post_init__(self) -> None:
        if not self.turns:
            raise ValueError(f"TraceExample {self.state_id!r} has no turns (the state is empty)")
        if (self.chosen is None) != (self.rejected is None):
            raise ValueError(
                f"TraceExample {self.state_id!r}: give both chosen and rejected, or neither"
            )

    @property
    def pairs(self) -> list[tuple[str, str]]:
        """Every ``(chosen, rejected)`` pair of this state."""
        first = [] if self.chosen is None else [(self.chosen, self.rejected or "")]
        return first + list(self.more_pairs)

    @classmethod
    def from_dict(cls, trace: Mapping[str, Any]) -> TraceExample:
        """A trace dict (``trace_id``, ``turns``, ``final_reward``, ``dpo_pairs``) as one
        decision: the last assistant turn is the response, the turns before it the state.

        Assistant ``tool_calls`` (``{"name", "arguments"}`` or OpenAI's ``{"function":
        {...}}``) are rendered after the text as ``<tool_call name="...">`` blocks; a tool
        turn's ``error`` (text) or ``is_error`` (its content is the error) marks an error
        site. Raises ``ValueError`` naming the trace when it has no assistant turn.
        """
        trace_id = str(trace.get("trace_id", trace.get("state_id", "")))
        raw = list(trace.get("turns") or trace.get("messages") or [])
        last = max((i for i, t in enumerate(raw) if t.get("role") == "assistant"), default=None)
        if last is None or last == 0:
            raise ValueError(
                f"trace {trace_id!r} has no assistant turn after its first turn: nothing to "
                "train on (the last assistant turn is the response)"
            )
        turns = tuple(_turn_from_dict(t) for t in raw[:last])
        rewards = dict(trace.get("rewards") or {})
        if "final_reward" in trace:
            rewards.setdefault("final_reward", float(trace["final_reward"]))
        pairs = [
            (str(p["chosen"]), str(p["rejected"]))
            for p in trace.get("dpo_pairs") or ()
            if p.get("chosen") is not None and p.get("rejected") is not None
        ]
        metadata = trace.get("metadata") or {}
        return cls(
            turns=turns,
            response=_assistant_text(raw[last]),
            rewards=rewards,
            error=trace.get("error"),
            error_kind=trace.get("error_kind"),
            chosen=pairs[0][0] if pairs else None,
            rejected=pairs[0][1] if pairs else None,
            more_pairs=tuple(pairs[1:]),
            available_tools=tuple(trace.get("available_tools") or metadata.get("tools") or ()),
            state_id=trace_id,
            task_id=trace.get("task_id", metadata.get("task_id")),
        )

    def messages(self) -> list[dict[str, str]]:
        return [t.message() for t in self.turns]

    def error_site(self) -> HintContext | None:
        """What the hint generator needs about this example's error, or None."""
        last = self.turns[-1]
        text = self.error or (last.error if last.role in _OBSERVATION_ROLES else None)
        if not text:
            return None
        ctx = HintContext(
            error_kind=self.error_kind or classify_error(text) or "runtime_error",
            error_message=text,
        )
        if last.tool_name:
            ctx["tool_name"] = last.tool_name
        if self.available_tools:
            ctx["available_tools"] = self.available_tools
        return ctx


def _call_parts(call: Mapping[str, Any]) -> tuple[str, Any]:
    function = call.get("function") if isinstance(call.get("function"), Mapping) else call
    arguments = function.get("arguments", function.get("input", {}))
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # else: the string the agent wrote
            arguments = json.loads(arguments)
    return str(function.get("name", "")), arguments


def _assistant_text(turn: Mapping[str, Any]) -> str:
    from composer_replication.traces.ingestion.render import render_tool_call

    parts = [str(turn.get("content") or "")] if turn.get("content") else []
    parts += [render_tool_call(*_call_parts(c)) for c in turn.get("tool_calls") or ()]
    return "\n\n".join(parts)


def _turn_from_dict(turn: Mapping[str, Any]) -> TraceTurn:
    role = str(turn.get("role", ""))
    if role == "assistant":
        return TraceTurn(role, _assistant_text(turn))
    content = str(turn.get("content") or "")
    error = turn.get("error")
    if error is None and turn.get("is_error"):
        error = content
    name = turn.get("tool_name", turn.get("name"))
    return TraceTurn(role, content, tool_name=name, error=None if error is None else str(error))


HintGenerator = Callable[[str, HintContext], "str | None"]


@dataclass(frozen=True)
class CollatorConfig:
    """Caps, padding and channel switches of ``ComposerDataCollator``.

    ``hint_generator`` is called as ``hint_generator(error_kind, ctx) -> hint | None``
    (``composer_replication.hint_generator.dispatch`` fits); None disables SDPO. ``split``:
    examples whose ``task_id`` it holds out raise ``HeldoutLeakError`` (the project's split
    by default; None for data with no held-out pool).
    """

    max_seq_len: int = 4096
    max_dpo_seq_len: int = 2048
    pad_token_id: int = 0
    ignore_index: int = -100
    enable_sdpo: bool = True
    hint_generator: HintGenerator | None = None
    enable_replay_dpo: bool = True
    rlvr_reward_key: str = "final_reward"
    split: HeldoutSplit | None = DEFAULT_SPLIT

    def __post_init__(self) -> None:
        for name in ("max_seq_len", "max_dpo_seq_len"):
            if getattr(self, name) < 2:
                raise ValueError(
                    f"{name}={getattr(self, name)} must be >= 2 (a prompt token and a response token)"
                )


class ComposerDataCollator:
    """Collate ``TraceExample``s into the ``compose_loss`` batch (see the module docstring)."""

    def __init__(self, tokenizer: TokenizerLike, config: CollatorConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.config = config or CollatorConfig()

    def __call__(
        self, examples: Sequence[TraceExample | Mapping[str, Any]]
    ) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("ComposerDataCollator got no examples")
        examples = [
            ex if isinstance(ex, TraceExample) else TraceExample.from_dict(ex) for ex in examples
        ]
        if self.config.split is not None:
            self.config.split.check_trainable([ex.task_id for ex in examples if ex.task_id])
        cfg = self.config
        responses = [self._response_ids(ex.response) for ex in examples]
        rows = [
            _fit(self._prompt_ids(ex.messages()), resp, cfg.max_seq_len)
            for ex, resp in zip(examples, responses)
        ]
        batch = self._pad(rows, "")
        labels = batch["input_ids"].clone()
        labels[batch["response_mask"] == 0] = cfg.ignore_index
        batch["labels"] = labels
        batch["rewards"] = torch.tensor(
            [self._reward(i, ex) for i, ex in enumerate(examples)], dtype=torch.float32
        )
        if cfg.enable_sdpo and cfg.hint_generator is not None:
            batch.update(self._sdpo_fields(examples, rows, batch["response_mask"]))
        if cfg.enable_replay_dpo:
            batch.update(self._dpo_fields(examples))
        return batch

    # ------------------------------------------------------------------ pieces

    def _prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return render_prompt(self.tokenizer, messages)

    def _response_ids(self, text: str) -> list[int]:
        ids = [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        eos = self.tokenizer.eos_token_id
        return [*ids, int(eos)] if eos is not None else ids

    def _reward(self, index: int, example: TraceExample) -> float:
        key = self.config.rlvr_reward_key
        if key not in example.rewards:
            raise ValueError(
                f"example {index} ({example.state_id!r}) has no reward {key!r} (rewards: "
                f"{sorted(example.rewards)}); add it or set CollatorConfig.rlvr_reward_key"
            )
        return float(example.rewards[key])

    def _sdpo_fields(
        self,
        examples: Sequence[TraceExample],
        rows: list[tuple[list[int], list[int]]],
        response_mask: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        hints: list[str | None] = []
        for ex in examples:
            site = ex.error_site()
            hints.append(
                None if site is None else self.config.hint_generator(site["error_kind"], site)
            )
        if not any(hints):
            return {}
        teacher = []
        for ex, hint, (_, resp) in zip(examples, hints, rows):
            messages = ex.messages()
            if hint:
                messages = augment_messages(messages, DEFAULT_HINT_TEMPLATE, hint=hint)
            teacher.append(_fit(self._prompt_ids(messages), resp, self.config.max_seq_len))
        out = self._pad(teacher, "ctx_teacher_")
        has_hint = torch.tensor([bool(h) for h in hints], dtype=torch.long)
        out["sdpo_loss_mask"] = response_mask * has_hint[:, None]
        return out

    def _dpo_fields(self, examples: Sequence[TraceExample]) -> dict[str, torch.Tensor]:
        pairs = [(ex, pair) for ex in examples for pair in ex.pairs]
        if not pairs:
            return {}
        out: dict[str, torch.Tensor] = {}
        cap = self.config.max_dpo_seq_len
        for k, side in enumerate(("chosen", "rejected")):
            rows = [
                _fit(self._prompt_ids(ex.messages()), self._response_ids(pair[k]), cap)
                for ex, pair in pairs
            ]
            out.update(self._pad(rows, f"dpo_{side}_"))
        return out

    def _pad(
        self, rows: Sequence[tuple[list[int], list[int]]], prefix: str
    ) -> dict[str, torch.Tensor]:
        width = max(len(p) + len(r) for p, r in rows)
        ids = torch.full((len(rows), width), self.config.pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        resp = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (prompt, response) in enumerate(rows):
            n_p, n_r = len(prompt), len(response)
            ids[i, : n_p + n_r] = torch.tensor(prompt + response, dtype=torch.long)
            attn[i, : n_p + n_r] = 1
            resp[i, n_p : n_p + n_r] = 1
        return {
            f"{prefix}input_ids": ids,
            f"{prefix}attention_mask": attn,
            f"{prefix}response_mask": resp,
        }


def _fit(prompt: list[int], response: list[int], cap: int) -> tuple[list[int], list[int]]:
    """(prompt, response) cut to ``cap`` tokens: response from the right (leaving one
    prompt token), then the prompt from the left."""
    response = response[: cap - 1]
    return prompt[-(cap - len(response)) :], response
