"""Rendering a multi-turn conversation to token ids without re-tokenising earlier turns.

``ChatRenderer`` asks the chat template for the ids of a prompt and for the delta a new
tool message adds (the observation tokens), detecting templates without a ``tool`` role
(the message then goes in as a user message prefixed ``[tool result]``) and templates that
rewrite history (a stand-in conversation is rendered instead). With ``tools`` (JSON
schemas, for a template with tool calls of its own) every rendering passes them to the
template, so the tools it shows stay in place turn after turn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TOOL_RESULT_PREFIX = "[tool result]"
_SENTINEL = "\x1fcr-sentinel\x1f"
_STAND_IN = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]


def ids_of(encoded: Any) -> list[int]:
    """Token ids from a tokenizer/template result (a list or a BatchEncoding)."""
    if hasattr(encoded, "keys"):  # newer transformers return a BatchEncoding
        encoded = encoded["input_ids"]
    return list(encoded)


@dataclass(frozen=True)
class ObservationTokens:
    """The tokens an observation adds: ``message`` (the tool message as rendered, its role
    ``role``), then ``header`` (the next assistant turn's generation prompt); ``how`` they
    were found (see :meth:`ChatRenderer.observation_ids`)."""

    message: list[int]
    header: list[int]
    role: str
    how: str

    @property
    def ids(self) -> list[int]:
        return [*self.message, *self.header]


class ChatRenderer:
    """Turns chat messages into token ids with the tokenizer's chat template.

    Attributes:
        tool_role: "tool" when the template renders a tool message, else "user" (the
            content then starts with ``[tool result]``).
        turn_close_ids: what the template writes after an assistant message's content
            (e.g. ``<|im_end|>\\n``).
        tools: the JSON schemas given to the template with every rendering (None: none).
    """

    def __init__(self, tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = [dict(t) for t in tools] if tools else None
        self.tool_role = self._probe_tool_role()
        self.turn_close_ids = self._probe_turn_close()

    def _template(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> Any:
        if self.tools is not None:
            kwargs["tools"] = self.tools
        return self.tokenizer.apply_chat_template(list(messages), **kwargs)

    def _text(self, messages: Sequence[Mapping[str, str]], generation_prompt: bool) -> str:
        return self._template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return ids_of(self.tokenizer(text, add_special_tokens=False))

    def _probe_tool_role(self) -> str:
        probe = [*_STAND_IN, {"role": "tool", "content": _SENTINEL}]
        try:
            text = self._text(probe, True)
        except Exception:  # templates that only know user/assistant raise on "tool"
            return "user"
        return "tool" if _SENTINEL in text else "user"

    def _probe_turn_close(self) -> list[int]:
        messages = [_STAND_IN[0], {"role": "assistant", "content": _SENTINEL}]
        text = self._text(messages, False)
        at = text.rfind(_SENTINEL)
        if at < 0:
            raise ValueError("the chat template drops assistant messages; it cannot render turns")
        return self._encode(text[at + len(_SENTINEL) :])

    def prompt_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The prompt: ``messages`` rendered with the generation prompt."""
        return ids_of(self._template(messages, tokenize=True, add_generation_prompt=True))

    def tool_message(self, content: str) -> dict[str, str]:
        """The message that carries a tool's output."""
        if self.tool_role == "tool":
            return {"role": "tool", "content": content}
        return {"role": "user", "content": f"{TOOL_RESULT_PREFIX} {content}"}

    def observation_ids(
        self, conversation: Sequence[Mapping[str, str]], message: Mapping[str, str]
    ) -> ObservationTokens:
        """The tokens of ``message`` + the next generation prompt after ``conversation``
        (which ends with a closed assistant message), and how they were found.

        "delta": the token delta of the real conversation (its rendering before is a prefix
        of its rendering after). When the template rewrites history, "stand_in": the text
        delta of the message after a fixed stand-in conversation, or "alone": the message
        rendered on its own. The message's tokens and the generation prompt's are told
        apart by rendering once without the generation prompt.
        """
        role = str(message.get("role", "tool"))
        before = self.turns_ids(conversation)
        after = ids_of(
            self._template([*conversation, message], tokenize=True, add_generation_prompt=True)
        )
        if len(after) > len(before) and after[: len(before)] == before:
            closed = self.turns_ids([*conversation, message])
            return _split(after[len(before) :], closed[len(before) :], role, "delta")
        base = self._text(_STAND_IN, False)
        full = self._text([*_STAND_IN, message], True)
        if full.startswith(base):
            bare = self._text([*_STAND_IN, message], False)
            return _split(
                self._encode(full[len(base) :]), self._encode(bare[len(base) :]), role, "stand_in"
            )
        return _split(
            self._encode(self._text([message], True)),
            self._encode(self._text([message], False)),
            role,
            "alone",
        )

    def turns_ids(self, conversation: Sequence[Mapping[str, str]]) -> list[int]:
        """``conversation`` rendered without a generation prompt."""
        return ids_of(self._template(conversation, tokenize=True, add_generation_prompt=False))


def _split(ids: list[int], message: list[int], role: str, how: str) -> ObservationTokens:
    """``ids`` (message + generation prompt) cut after the message's own tokens (when they
    are a prefix of ``ids``; otherwise all of it counts as the message)."""
    n = len(message) if ids[: len(message)] == message else len(ids)
    return ObservationTokens(list(ids[:n]), list(ids[n:]), role, how)
