"""Chat history entries, token counting, and truncation of the oldest history.

A state's context is `[system prompt] + history`. With a token budget, whole entries are
dropped from the oldest end until the context fits, never the system prompt and never the
latest user turn (the last user entry and whatever follows it); a history that would then
start with an assistant entry loses that entry too, so the context opens with a user turn.
If the protected part alone is over budget, it is kept whole: a state is never cut
mid-message.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from composer_replication.traces.teacher_replay.records import ChatMessage

__all__ = [
    "MESSAGE_OVERHEAD_TOKENS",
    "Entry",
    "TokenCounter",
    "estimate_tokens",
    "hf_token_counter",
    "merge_entries",
    "truncate_history",
]

TokenCounter = Callable[[str], int]

# Role markers and separators a chat template adds around each message.
MESSAGE_OVERHEAD_TOKENS = 4


def estimate_tokens(text: str) -> int:
    """A tokenizer-free estimate: max(whitespace-separated words, ceil(chars / 4))."""
    return max(len(text.split()), math.ceil(len(text) / 4))


def hf_token_counter(tokenizer: Any) -> TokenCounter:
    """A counter from a Hugging Face tokenizer (no special tokens added)."""

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    return count


@dataclass(frozen=True)
class Entry:
    """One history entry: a rendered message part and its token count."""

    role: str
    content: str
    tokens: int


def truncate_history(
    entries: Sequence[Entry], system_tokens: int, max_tokens: int | None
) -> tuple[list[Entry], int]:
    """(kept entries, number dropped) so that the context fits `max_tokens` if it can."""
    kept = list(entries)
    if max_tokens is None:
        return kept, 0
    total = system_tokens + MESSAGE_OVERHEAD_TOKENS
    total += sum(e.tokens + MESSAGE_OVERHEAD_TOKENS for e in kept)
    if total <= max_tokens:
        return kept, 0
    # The latest user turn: the run of user entries (merged into one message) that holds
    # the last user entry.
    protect = max((i for i, e in enumerate(kept) if e.role == "user"), default=len(kept))
    while protect > 0 and kept[protect - 1].role == "user":
        protect -= 1
    drop = 0
    while drop < protect and total > max_tokens:
        total -= kept[drop].tokens + MESSAGE_OVERHEAD_TOKENS
        drop += 1
    while drop < protect and kept[drop].role != "user":
        drop += 1
    return kept[drop:], drop


def merge_entries(system_prompt: str, entries: Sequence[Entry]) -> list[ChatMessage]:
    """`[system] + entries`, consecutive entries of one role merged (blank-line joined)."""
    messages: list[ChatMessage] = [ChatMessage(role="system", content=system_prompt)]
    for entry in entries:
        if len(messages) > 1 and messages[-1]["role"] == entry.role:
            messages[-1] = ChatMessage(
                role=entry.role, content=f"{messages[-1]['content']}\n\n{entry.content}"
            )
        else:
            messages.append(ChatMessage(role=entry.role, content=entry.content))
    return messages
