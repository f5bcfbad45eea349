"""Ingestion: real agent traces -> `TraceState` streams.

`claude_code.ClaudeCodeIngester` reads Claude Code session files; `render` documents how
tool calls and results appear in the chat history; `history` counts tokens and truncates
the oldest history to a budget.
"""

from __future__ import annotations

from composer_replication.traces.ingestion.claude_code import (
    KNOWN_VERSION_RANGE,
    SYSTEM_PROMPT,
    ClaudeCodeIngester,
    IngestionStats,
)
from composer_replication.traces.ingestion.history import estimate_tokens, hf_token_counter

__all__ = [
    "KNOWN_VERSION_RANGE",
    "SYSTEM_PROMPT",
    "ClaudeCodeIngester",
    "IngestionStats",
    "estimate_tokens",
    "hf_token_counter",
]
