"""Rendering a multi-turn conversation to token ids without re-tokenising earlier turns.

``ChatRenderer`` asks the chat template for the ids of a prompt and for the delta a new
tool message adds (the observation tokens), detecting templates without a ``tool`` role
(the message then goes in as a user message prefixed ``[tool result]``) and templates that
rewrite history (a stand-in conversation is rendered instead).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

TOOL_RESULT_PREFIX = "[tool result]"
_SENTINEL = "\x1fcr-sentinel\x1f"
_STAND_IN = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]


def ids_of(encoded: Any) -> list[int]:
    """Token ids from a tokenizer/template result (a list or a BatchEncoding)."""
    if hasattr(encoded, "keys"):  # newer transformers return a BatchEncoding
        encoded = encoded["input_ids"]
    return list(encoded)


class ChatRenderer:
    """Turns chat messages into token ids with the tokenizer's chat template.

    Attributes:
        tool_role: "tool" when the template renders a tool message, else "user" (the
            content then starts with ``[tool result]``).
        turn_close_ids: what the template writes after an assistant message's content
            (e.g. ``<|im_end|>\\n``).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tool_role = self._probe_tool_role()
        self.turn_close_ids = self._probe_turn_close()

    def _text(self, messages: Sequence[Mapping[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt
        )

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
        return ids_of(
            self.tokenizer.apply_chat_template(
                list(messages), tokenize=True, add_generation_prompt=True
            )
        )

    def tool_message(self, content: str) -> dict[str, str]:
        """The message that carries a tool's output."""
        if self.tool_role == "tool":
            return {"role": "tool", "content": content}
        return {"role": "user", "content": f"{TOOL_RESULT_PREFIX} {content}"}

    def observation_ids(
        self, conversation: Sequence[Mapping[str, str]], message: Mapping[str, str]
    ) -> tuple[list[int], str]:
        """Ids of ``message`` + the next generation prompt after ``conversation`` (which ends
        with a closed assistant message), and how they were found.

        "delta": the token delta of the real conversation (its rendering before is a prefix of
        its rendering after). When the template rewrites history, "stand_in": the text delta
        of the message after a fixed stand-in conversation, or "alone": the message rendered
        on its own.
        """
        before = self.turns_ids(conversation)
        after = ids_of(
            self.tokenizer.apply_chat_template(
                [*conversation, message], tokenize=True, add_generation_prompt=True
            )
        )
        if len(after) > len(before) and after[: len(before)] == before:
            return after[len(before) :], "delta"
        base = self._text(_STAND_IN, False)
        full = self._text([*_STAND_IN, message], True)
        if full.startswith(base):
            return self._encode(full[len(base) :]), "stand_in"
        return self._encode(self._text([message], True)), "alone"

    def turns_ids(self, conversation: Sequence[Mapping[str, str]]) -> list[int]:
        """``conversation`` rendered without a generation prompt."""
        return ids_of(
            self.tokenizer.apply_chat_template(
                list(conversation), tokenize=True, add_generation_prompt=False
            )
        )
