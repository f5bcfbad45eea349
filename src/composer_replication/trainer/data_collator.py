"""Agent-trace examples -> the padded batch dict of ``loss.compose_loss``.

A ``TraceExample`` is one decision of an agent: the conversation so far (``turns``), the
action taken (``response``), its rewards, optionally the error it ran into and teacher
preference pairs for the same state. ``ComposerDataCollator(tokenizer, config)(examples)``
builds the three channels' inputs (the key layout of :mod:`composer_replication.batch`).
Examples may also be given as trace dicts (:meth:`TraceExample.from_dict`), the documented
``TraceExample`` TypedDict shape: ``trace_id``, ``turns`` (``role`` / ``content`` messages;
assistant ``tool_call`` / ``tool_calls``; tool ``name``, ``tool_error`` / ``error`` /
``is_error`` and ``error_meta``), ``final_reward`` and ``dpo_pairs`` (``chosen`` /
``rejected``); the last assistant turn is the response trained on, the turns before it are
the state, and an error reported after it is the failure it led to.

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
from dataclasses import InitVar, dataclass, field
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
    """One message of a trace.

    The fields of the documented ``TraceTurn`` TypedDict are accepted as keywords:
    ``tool_call`` (an assistant turn's call, ``{"name", "arguments"}`` or OpenAI's
    ``{"function": {...}}``, rendered after the text as a ``<tool_call name="...">`` block),
    ``tool_error`` (the same as ``error``: the failure this observation reports, e.g. a tool
    error or failing tests) and ``error_meta`` (what is known about that error, as
    ``hint_generator.HintContext`` keys: ``error_kind``, ``tool_name``, ``available_tools``,
    ``tool_schema``, ``intent``; passed on to the hint generator). ``tool_name`` is the tool
    that produced an observation.
    """

    role: str
    content: str = ""
    tool_name: str | None = None
    error: str | None = None
    tool_call: Mapping[str, Any] | None = None
    tool_error: str | None = None
    error_meta: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"TraceTurn role {self.role!r} is not one of {ROLES}")
        if self.error is not None and self.tool_error is not None and self.error != self.tool_error:
            raise ValueError(
                f"TraceTurn: error={self.error!r} and tool_error={self.tool_error!r} differ; "
                "they name the same failure, give one"
            )
        failure = self.error if self.error is not None else self.tool_error
        object.__setattr__(self, "error", failure)
        object.__setattr__(self, "tool_error", failure)
        # None-valued keys say nothing (a table of traces fills every turn with every key)
        meta = {k: v for k, v in (self.error_meta or {}).items() if v is not None}
        object.__setattr__(self, "error_meta", meta or None)
        if self.tool_call is not None and not _call_parts(self.tool_call)[0]:
            object.__setattr__(self, "tool_call", None)
        if self.tool_name is None and self.error_meta and self.error_meta.get("tool_name"):
            object.__setattr__(self, "tool_name", str(self.error_meta["tool_name"]))

    @property
    def reports_error(self) -> bool:
        """An observation turn that reports a failure (an error text, or error metadata)."""
        return self.role in _OBSERVATION_ROLES and bool(self.error or self.error_meta)

    def text(self) -> str:
        """The content, with an assistant's ``tool_call`` rendered after it."""
        if self.role != "assistant" or not self.tool_call:
            return self.content
        from composer_replication.traces.ingestion.render import render_tool_call

        call = render_tool_call(*_call_parts(self.tool_call))
        return f"{self.content}\n\n{call}" if self.content else call

    def message(self) -> dict[str, str]:
        return {"role": self.role, "content": self.text()}


@dataclass(frozen=True)
class TraceExample:
    """One agent decision: ``turns`` (the state), ``response`` (the action trained on).

    The documented ``TraceExample`` TypedDict shape is accepted as keywords too:
    ``TraceExample(trace_id=..., turns=[...], final_reward=..., dpo_pairs=[...])``, with
    ``turns`` as ``TraceTurn``s or turn dicts (``role``, ``content``, ``tool_call``,
    ``tool_error``, ``error_meta``, ...). Without ``response`` the last assistant turn is the
    response and the turns before it are the state; an error reported by a turn after it is
    the failure the response led to (``error`` / ``error_meta``).

    Attributes:
        turns: the conversation before the response (at least one turn).
        response: the assistant text that was produced at this state.
        rewards: named scalar rewards; ``CollatorConfig.rlvr_reward_key`` is the one used.
        error: the failure the response led to (failing tests, tool error); the error site
            SDPO hints about. Without it, an error reported by the last observation turn of
            the state counts.
        error_kind: a ``hint_generator.HINT_TEMPLATES`` key (default: ``error_meta``'s
            ``error_kind``, else ``classify_error``).
        chosen / rejected: a teacher preference pair for the same state (both or neither).
        available_tools: tool names offered to the agent (for tool hints).
        state_id: free-form id, reported in errors (``trace_id`` sets it).
        more_pairs: further ``(chosen, rejected)`` pairs for the same state.
        task_id: the environment task the trace worked on, when known: a held-out task is
            refused by the collator (``CollatorConfig.split``).
        error_meta: hint-context keys about ``error`` (see ``TraceTurn``).
        trace_id / final_reward / dpo_pairs: the TypedDict spellings (init only): the
            ``state_id``, ``rewards["final_reward"]`` and the pairs (``chosen`` /
            ``rejected`` dicts).
    """

    turns: tuple[TraceTurn, ...]
    response: str | None = None
    rewards: Mapping[str, float] = field(default_factory=dict)
    error: str | None = None
    error_kind: str | None = None
    chosen: str | None = None
    rejected: str | None = None
    available_tools: tuple[str, ...] = ()
    state_id: str = ""
    more_pairs: tuple[tuple[str, str], ...] = ()
    task_id: str | None = None
    error_meta: Mapping[str, Any] | None = None
    trace_id: InitVar[str | None] = None
    final_reward: InitVar[float | None] = None
    dpo_pairs: InitVar[Sequence[Mapping[str, Any]] | None] = None

    def __post_init__(
        self,
        trace_id: str | None,
        final_reward: float | None,
        dpo_pairs: Sequence[Mapping[str, Any]] | None,
    ) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if trace_id is not None and not self.state_id:
            put("state_id", str(trace_id))
        turns = tuple(t if isinstance(t, TraceTurn) else _turn_from_dict(t) for t in self.turns)
        if self.response is None:
            turns = self._split_response(turns)
        put("turns", turns)
        put("available_tools", tuple(self.available_tools))
        if final_reward is not None:
            put("rewards", {"final_reward": float(final_reward), **dict(self.rewards)})
        pairs = [
            (str(p["chosen"]), str(p["rejected"]))
            for p in dpo_pairs or ()
            if p.get("chosen") is not None and p.get("rejected") is not None
        ]
        if pairs and self.chosen is None and self.rejected is None:
            put("chosen", pairs[0][0])
            put("rejected", pairs[0][1])
            put("more_pairs", tuple(pairs[1:]) + tuple(self.more_pairs))
        if self.error_meta is not None:
            put("error_meta", dict(self.error_meta))
        if not self.turns:
            raise ValueError(f"TraceExample {self.state_id!r} has no turns (the state is empty)")
        if (self.chosen is None) != (self.rejected is None):
            raise ValueError(
                f"TraceExample {self.state_id!r}: give both chosen and rejected, or neither"
            )

    def _split_response(self, turns: tuple[TraceTurn, ...]) -> tuple[TraceTurn, ...]:
        """The last assistant turn becomes ``response``; an error a later turn reports
        becomes ``error`` / ``error_meta``; returns the state (the turns before it)."""
        last = max((i for i, t in enumerate(turns) if t.role == "assistant"), default=None)
        if last is None or last == 0:
            raise ValueError(
                f"trace {self.state_id!r} has no assistant turn after its first turn: nothing "
                "to train on (the last assistant turn is the response)"
            )
        object.__setattr__(self, "response", turns[last].text())
        after = [t for t in turns[last + 1 :] if t.reports_error]
        if after and self.error is None:
            object.__setattr__(self, "error", after[-1].error or after[-1].content)
            if self.error_meta is None and after[-1].error_meta:
                object.__setattr__(self, "error_meta", after[-1].error_meta)
        return turns[:last]

    @property
    def pairs(self) -> list[tuple[str, str]]:
        """Every ``(chosen, rejected)`` pair of this state."""
        first = [] if self.chosen is None else [(self.chosen, self.rejected or "")]
        return first + list(self.more_pairs)

    @classmethod
    def from_dict(cls, trace: Mapping[str, Any]) -> TraceExample:
        """A trace dict (``trace_id``, ``turns``, ``final_reward``, ``dpo_pairs``) as one
        decision: the last assistant turn is the response, the turns before it the state.

        Assistant ``tool_calls`` (a list) or ``tool_call`` (one; ``{"name", "arguments"}``
        or OpenAI's ``{"function": {...}}``) are rendered after the text as
        ``<tool_call name="...">`` blocks; a turn's ``tool_error`` / ``error`` (text) or
        ``is_error`` (its content is the error) marks an error site, with ``error_meta``
        for the hint generator. Raises ``ValueError`` naming the trace when it has no
        assistant turn.
        """
        metadata = trace.get("metadata") or {}
        trace_id = trace.get("trace_id")
        if trace_id is None:
            trace_id = trace.get("state_id")
        task_id = trace.get("task_id")
        return cls(
            turns=tuple(trace.get("turns") or trace.get("messages") or ()),
            trace_id="" if trace_id is None else str(trace_id),
            rewards=dict(trace.get("rewards") or {}),
            final_reward=trace.get("final_reward"),
            dpo_pairs=trace.get("dpo_pairs"),
            error=trace.get("error"),
            error_kind=trace.get("error_kind"),
            error_meta=trace.get("error_meta"),
            available_tools=tuple(trace.get("available_tools") or metadata.get("tools") or ()),
            task_id=task_id if task_id is not None else metadata.get("task_id"),
        )

    def messages(self) -> list[dict[str, str]]:
        return [t.message() for t in self.turns]

    def error_site(self) -> HintContext | None:
        """What the hint generator needs about this example's error, or None: the
        example's ``error`` (with ``error_meta``), else the error the last observation turn
        reports (with its ``error_meta``)."""
        last = self.turns[-1]
        if self.error:
            text, meta = self.error, dict(self.error_meta or {})
        elif last.reports_error:
            meta = dict(last.error_meta or {})
            text = last.error or str(meta.get("error_message") or last.content)
        else:
            return None
        ctx = HintContext(**{k: v for k, v in meta.items() if k in HintContext.__annotations__})
        ctx["error_message"] = text
        ctx["error_kind"] = (
            self.error_kind or meta.get("error_kind") or classify_error(text) or "runtime_error"
        )
        if last.tool_name and "tool_name" not in ctx:
            ctx["tool_name"] = last.tool_name
        if self.available_tools and "available_tools" not in ctx:
            ctx["available_tools"] = self.available_tools
        return ctx


def _call_parts(call: Mapping[str, Any]) -> tuple[str, Any]:
    function = call.get("function") if isinstance(call.get("function"), Mapping) else call
    arguments = function.get("arguments")
    if arguments is None:
        arguments = function.get("input")
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # else: the string the agent wrote
            arguments = json.loads(arguments)
    return str(function.get("name") or ""), arguments


def _assistant_text(turn: Mapping[str, Any]) -> str:
    from composer_replication.traces.ingestion.render import render_tool_call

    calls = [*(turn.get("tool_calls") or ()), turn.get("tool_call")]
    calls = [c for c in calls if isinstance(c, Mapping) and _call_parts(c)[0]]
    parts = [str(turn.get("content") or "")] if turn.get("content") else []
    parts += [render_tool_call(*_call_parts(c)) for c in calls]
    return "\n\n".join(parts)


def _turn_from_dict(turn: Mapping[str, Any]) -> TraceTurn:
    role = str(turn.get("role", ""))
    if role == "assistant":
        return TraceTurn(role, _assistant_text(turn))
    content = str(turn.get("content") or "")
    error = turn.get("tool_error")
    if error is None:
        error = turn.get("error")
    if error is None and turn.get("is_error"):
        error = content
    name = turn.get("tool_name") or turn.get("name")
    meta = turn.get("error_meta")
    return TraceTurn(
        role,
        content,
        tool_name=None if name is None else str(name),
        error=None if error is None else str(error),
        error_meta=dict(meta) if meta else None,
    )


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
