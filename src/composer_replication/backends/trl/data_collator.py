"""Agent-trace examples -> the padded batch dict of ``loss.compose_loss``.

A ``TraceExample`` is an agent trace cut at its last action: the conversation before it
(``turns``), that action (``response``), its rewards, optionally the error it ran into and
teacher preference pairs for the same state. ``ComposerDataCollator(tokenizer,
config)(examples)`` builds the three channels' inputs (the key layout of
:mod:`composer_replication.ops.compose_batch`). Examples may also be given as trace dicts
(:meth:`TraceExample.from_dict`), the documented ``TraceExample`` TypedDict shape:
``trace_id``, ``turns`` (``role`` / ``content`` messages; assistant ``tool_call`` /
``tool_calls``; tool ``name``, ``tool_error`` / ``error`` / ``is_error`` and ``error_meta``),
``final_reward`` and ``dpo_pairs`` (``chosen`` / ``rejected``); the last assistant turn is the
response, the turns before it are the state, and an error reported after it is the failure
it led to.

What is trained (``response_mask``, ``labels``). The trained turns are the response and,
with ``CollatorConfig.multi_turn`` (the default), every assistant turn of the state after its
first turn. A row is the conversation up to the first trained turn, rendered with the chat
template and its generation prompt, followed by the rest of the conversation as tokens:
each trained turn is its text tokens + eos (tokenised once; 1 in ``response_mask``), and
the turns between two trained turns are the chat template's own tokens for them (0): the
ids the template adds when those turns and the next generation prompt are appended (the
previous turn's end-of-turn text after eos, e.g. ChatML's newline, included). The row then
equals the template's tokens of the whole conversation, up to the last turn's eos. When the
template does not extend its earlier rendering that way (it rewrites history, e.g. drops
old reasoning, or tokenises a turn differently in context), the turns in between are the
delta they add after a fixed stand-in exchange (``user: "."``, ``assistant: "."``; a
leading eos, already ending the trained turn, dropped), else their rendering on their own.
With ``multi_turn=False`` only the response is trained and every earlier turn is prompt.

- always: ``input_ids``, ``attention_mask``, ``response_mask`` (B, T), ``labels`` (B, T)
  (``input_ids`` with ``ignore_index`` off the trained turns) and ``rewards`` (B,) float,
  read from ``example.rewards[config.rlvr_reward_key]``;
- SDPO, when ``enable_sdpo``, a ``hint_generator`` is configured and some error site gets
  a hint: ``ctx_teacher_input_ids``, ``ctx_teacher_attention_mask``,
  ``ctx_teacher_response_mask`` (B, T') and ``sdpo_loss_mask`` (B, T). The error sites are
  the trained turns that (a) directly follow an observation turn (user / tool) reporting
  an error (``TraceTurn.reports_error``: the hint generator gets that turn's error and
  tool), or (b) are the response and the example has an ``error`` (reported after it:
  the failure it led to; ``TraceExample.error_site``). A site's hint is written with
  ``DEFAULT_HINT_TEMPLATE`` into the turns between the previous trained turn (or the
  start) and the site, as ``algo.context.augment_messages`` does: into the last user
  message there, else as a new user message right before the site. The teacher context is
  the conversation with every hint of the row written in, rendered the same way, with the
  SAME ids for every trained turn; ``ctx_teacher_response_mask`` marks all of them (as many
  tokens as ``response_mask``, in the same order: token k of one is token k of the other),
  and ``sdpo_loss_mask`` (student shape) is 1 on the tokens of the sites that got a hint.
  A later site's teacher thus also sees the earlier sites' hints. Rows without a hint keep
  the plain conversation and an all-zero ``sdpo_loss_mask`` row. For a single trained turn
  this is the old rule: the hint in the state's last user message;
- replay DPO, when ``enable_replay_dpo`` and some example carries pairs:
  ``dpo_{chosen,rejected}_{input_ids,attention_mask,response_mask}`` (P, T''), one row per
  pair (the whole state as prompt + that response).

Truncation, to ``max_seq_len``: the prompt is cut from the left (the latest tokens kept,
at least one); when the trained turns and the turns between them still do not fit, whole
trailing turns are dropped (a trained turn with the turns before it, so a row never ends in
an observation nor holds part of one) and the prompt is cut again to the room left; a
first trained turn longer than ``max_seq_len - 1`` is cut from the right. With SDPO a row
keeps the trained turns its teacher context can hold too (hints only add tokens), and each
context's prompt is cut to fit. Pairs: the response cut from the right to
``max_dpo_seq_len - 1``, then the prompt from the left.
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
from composer_replication.samples.padding import pad_rows

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
    ``{"function": {...}}``, rendered after the text in the project's tool-call format),
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
    """An agent trace cut at its last action: ``turns`` (the state), ``response`` (the
    action); with ``CollatorConfig.multi_turn`` the state's own assistant turns are trained
    too (``earlier_actions``).

    The documented ``TraceExample`` TypedDict shape is accepted as keywords too:
    ``TraceExample(trace_id=..., turns=[...], final_reward=..., dpo_pairs=[...])``, with
    ``turns`` as ``TraceTurn``s or turn dicts (``role``, ``content``, ``tool_call``,
    ``tool_error``, ``error_meta``, ...). Without ``response`` the last assistant turn is the
    response and the turns before it are the state; an error reported by a turn after it is
    the failure the response led to (``error`` / ``error_meta``).

    Attributes:
        turns: the conversation before the response (at least one turn), earlier actions
            included.
        response: the assistant text that was produced at this state (the last action).
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
        becomes ``error`` / ``error_meta`` (with that turn's ``tool_name``); returns the state
        (the turns before it)."""
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
            if self.error_meta is None and (after[-1].error_meta or after[-1].tool_name):
                # the tool that failed, for the hint (the state's last turn is another one)
                meta = {"tool_name": after[-1].tool_name} if after[-1].tool_name else {}
                object.__setattr__(self, "error_meta", {**meta, **(after[-1].error_meta or {})})
        return turns[:last]

    @property
    def earlier_actions(self) -> tuple[int, ...]:
        """Indices into ``turns`` of the state's assistant turns after its first turn: the
        actions trained beside the response when ``CollatorConfig.multi_turn`` is on (an
        assistant turn that opens the conversation has no prompt before it and stays state)."""
        return tuple(i for i, t in enumerate(self.turns) if i > 0 and t.role == "assistant")

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
        calls in the project's tool-call format; a turn's ``tool_error`` / ``error`` (text) or
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
        """What the hint generator needs about the response's error, or None: the
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
        return self._hint_context(text, meta, self.error_kind, last.tool_name)

    def turn_error_site(self, index: int) -> HintContext | None:
        """What the hint generator needs about the error ``turns[index]`` reports (its error
        text, ``error_meta`` and tool), or None when that turn reports none. The action right
        after such a turn is an error site (see the module docstring)."""
        turn = self.turns[index]
        if not turn.reports_error:
            return None
        meta = dict(turn.error_meta or {})
        text = turn.error or str(meta.get("error_message") or turn.content)
        return self._hint_context(text, meta, None, turn.tool_name)

    def _hint_context(
        self, text: str, meta: dict[str, Any], kind: str | None, tool_name: str | None
    ) -> HintContext:
        ctx = HintContext(**{k: v for k, v in meta.items() if k in HintContext.__annotations__})
        ctx["error_message"] = text
        ctx["error_kind"] = (
            kind or meta.get("error_kind") or classify_error(text) or "runtime_error"
        )
        if tool_name and "tool_name" not in ctx:
            ctx["tool_name"] = tool_name
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
    by default; None for data with no held-out pool). ``multi_turn``: train every assistant
    turn of a trace after its first turn (``TraceExample.earlier_actions``) beside the
    response, each a possible SDPO site; False trains the response only, the earlier turns
    being prompt.
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
    multi_turn: bool = True

    def __post_init__(self) -> None:
        for name in ("max_seq_len", "max_dpo_seq_len"):
            if getattr(self, name) < 2:
                raise ValueError(
                    f"{name}={getattr(self, name)} must be >= 2 (a prompt token and a response token)"
                )


@dataclass(frozen=True)
class _Context:
    """One context (student or teacher) of an example, in pieces.

    ``prompt``: the conversation up to the first trained turn with the generation prompt;
    ``turns``: per trained turn, ``(ids of the turns before it since the previous trained
    turn, its own ids)``; the first has no ids before it (the prompt leads to it).
    """

    prompt: list[int]
    turns: list[tuple[list[int], list[int]]]

    def turns_that_fit(self, cap: int) -> int:
        """How many leading trained turns fit ``cap`` with at least one prompt token (at
        least 1: a first turn too long for the cap is cut)."""
        used, n = 1, 0
        for before, own in self.turns:
            used += len(before) + len(own)
            if used > cap:
                break
            n += 1
        return max(n, 1)

    def cut(self, n: int, cap: int) -> tuple[list[int], list[int]]:
        """(ids, turn of each id: its trained turn's index, -1 elsewhere) of the first ``n``
        trained turns, the first one cut to ``cap - 1`` when alone, after the prompt's tail."""
        turns = self.turns[:n]
        if n == 1:
            turns = [([], turns[0][1][: cap - 1])]
        body = sum(len(before) + len(own) for before, own in turns)
        ids = self.prompt[-(cap - body) :]
        marks = [-1] * len(ids)
        for j, (before, own) in enumerate(turns):
            ids += before + own
            marks += [-1] * len(before) + [j] * len(own)
        return ids, marks


@dataclass(frozen=True)
class _Layout:
    """An example's conversation split at its trained turns.

    ``stretches[j]``: the messages between trained turn j - 1 (or the start) and trained
    turn j; ``actions[j]``: trained turn j's message; ``at[j]``: its index in ``turns``
    (``len(turns)`` for the response).
    """

    stretches: list[list[dict[str, Any]]]
    actions: list[dict[str, str]]
    at: list[int]


class ComposerDataCollator:
    """Collate ``TraceExample``s into the ``compose_loss`` batch (see the module docstring)."""

    def __init__(self, tokenizer: TokenizerLike, config: CollatorConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.config = config or CollatorConfig()
        self._stand_in: list[int] | None = None

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
        layouts = [self._layout(ex) for ex in examples]
        action_ids = [[self._response_ids(a["content"]) for a in lay.actions] for lay in layouts]
        student = [
            self._context(lay.stretches, lay.actions, ids) for lay, ids in zip(layouts, action_ids)
        ]
        hints: list[dict[int, str]] = [{} for _ in examples]
        if cfg.enable_sdpo and cfg.hint_generator is not None:
            hints = [self._hints(ex, lay) for ex, lay in zip(examples, layouts)]
        teacher = None
        if any(hints):
            teacher = [
                self._context(self._hinted(lay, found), lay.actions, ids) if found else plain
                for lay, ids, found, plain in zip(layouts, action_ids, hints, student)
            ]
        # a row keeps the trained turns both of its contexts hold
        cap = cfg.max_seq_len
        kept = [ctx.turns_that_fit(cap) for ctx in student]
        if teacher is not None:
            kept = [min(n, ctx.turns_that_fit(cap)) for n, ctx in zip(kept, teacher)]
        rows = [ctx.cut(n, cap) for ctx, n in zip(student, kept)]
        batch = self._pad(rows, "")
        labels = batch["input_ids"].clone()
        labels[batch["response_mask"] == 0] = cfg.ignore_index
        batch["labels"] = labels
        batch["rewards"] = torch.tensor(
            [self._reward(i, ex) for i, ex in enumerate(examples)], dtype=torch.float32
        )
        if teacher is not None:
            batch.update(
                self._pad([ctx.cut(n, cap) for ctx, n in zip(teacher, kept)], "ctx_teacher_")
            )
            batch["sdpo_loss_mask"] = _site_mask(rows, hints, batch["input_ids"].shape[1])
        if cfg.enable_replay_dpo:
            batch.update(self._dpo_fields(examples))
        return batch

    # ------------------------------------------------------------------ pieces

    def _layout(self, example: TraceExample) -> _Layout:
        messages = example.messages()
        at = [*(example.earlier_actions if self.config.multi_turn else ()), len(messages)]
        messages.append({"role": "assistant", "content": example.response or ""})
        starts = [0, *(i + 1 for i in at[:-1])]
        return _Layout(
            stretches=[messages[s:e] for s, e in zip(starts, at)],
            actions=[messages[i] for i in at],
            at=at,
        )

    def _hints(self, example: TraceExample, layout: _Layout) -> dict[int, str]:
        """Trained turn index -> its hint, for the turns that are error sites and got one."""
        out: dict[int, str] = {}
        for j, at in enumerate(layout.at):
            if at == len(example.turns):
                site = example.error_site()
            else:
                site = example.turn_error_site(at - 1)
            hint = None if site is None else self.config.hint_generator(site["error_kind"], site)
            if hint:
                out[j] = hint
        return out

    @staticmethod
    def _hinted(layout: _Layout, hints: Mapping[int, str]) -> list[list[dict[str, Any]]]:
        return [
            augment_messages(stretch, DEFAULT_HINT_TEMPLATE, hint=hints[j])
            if j in hints
            else stretch
            for j, stretch in enumerate(layout.stretches)
        ]

    def _context(
        self,
        stretches: Sequence[list[dict[str, Any]]],
        actions: Sequence[dict[str, str]],
        action_ids: Sequence[list[int]],
    ) -> _Context:
        """Render a conversation turn by turn; the trained turns' ids are ``action_ids``."""
        conversation = list(stretches[0])
        prompt = self._prompt_ids(conversation)
        ids = list(prompt)
        turns = []
        for j, (action, own) in enumerate(zip(actions, action_ids)):
            before: list[int] = []
            if j:
                before = self._between_ids(conversation, stretches[j], ids)
                conversation += stretches[j]
            turns.append((before, own))
            ids += before + own
            conversation.append(action)
        return _Context(prompt, turns)

    def _between_ids(
        self, conversation: list[dict[str, Any]], stretch: list[dict[str, Any]], ids: list[int]
    ) -> list[int]:
        """The ids of ``stretch`` + the generation prompt after ``conversation`` (which ends
        with a trained turn, ``ids`` so far): the template's delta when its rendering extends
        ``ids``, else the delta after a stand-in exchange, else ``stretch`` on its own."""
        full = self._prompt_ids([*conversation, *stretch])
        if full[: len(ids)] == ids:
            return full[len(ids) :]
        if self._stand_in is None:
            head = self._prompt_ids(_STAND_IN[:1])
            self._stand_in = head + self._text_ids(_STAND_IN[1]["content"])
        full = self._prompt_ids([*_STAND_IN, *stretch])
        if full[: len(self._stand_in)] != self._stand_in:
            return self._prompt_ids(stretch)
        rest = full[len(self._stand_in) :]
        eos = self.tokenizer.eos_token_id
        return rest[1:] if eos is not None and rest[:1] == [int(eos)] else rest

    def _prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return render_prompt(self.tokenizer, messages)

    def _text_ids(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def _response_ids(self, text: str) -> list[int]:
        ids = self._text_ids(text)
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

    def _dpo_fields(self, examples: Sequence[TraceExample]) -> dict[str, torch.Tensor]:
        pairs = [(ex, pair) for ex in examples for pair in ex.pairs]
        if not pairs:
            return {}
        out: dict[str, torch.Tensor] = {}
        cap = self.config.max_dpo_seq_len
        for k, side in enumerate(("chosen", "rejected")):
            rows = []
            for ex, pair in pairs:
                prompt, response = _fit(
                    self._prompt_ids(ex.messages()), self._response_ids(pair[k]), cap
                )
                rows.append((prompt + response, [-1] * len(prompt) + [0] * len(response)))
            out.update(self._pad(rows, f"dpo_{side}_"))
        return out

    def _pad(
        self, rows: Sequence[tuple[list[int], list[int]]], prefix: str
    ) -> dict[str, torch.Tensor]:
        """(ids, turn marks) rows, right-padded; the response mask is where a mark is >= 0."""
        ids, attn = pad_rows([row for row, _ in rows], self.config.pad_token_id)
        resp, _ = pad_rows([[int(m >= 0) for m in marks] for _, marks in rows], width=ids.shape[1])
        return {
            f"{prefix}input_ids": ids,
            f"{prefix}attention_mask": attn,
            f"{prefix}response_mask": resp,
        }


_STAND_IN = ({"role": "user", "content": "."}, {"role": "assistant", "content": "."})


def _site_mask(
    rows: Sequence[tuple[list[int], list[int]]], hints: Sequence[Mapping[int, str]], width: int
) -> torch.Tensor:
    """(B, T) long: 1 on the tokens of the trained turns that got a hint."""
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, ((_, marks), found) in enumerate(zip(rows, hints)):
        mask[i, : len(marks)] = torch.tensor([int(m in found) for m in marks], dtype=torch.long)
    return mask


def _fit(prompt: list[int], response: list[int], cap: int) -> tuple[list[int], list[int]]:
    """(prompt, response) cut to ``cap`` tokens: response from the right (leaving one
    prompt token), then the prompt from the left."""
    response = response[: cap - 1]
    return prompt[-(cap - len(response)) :], response
