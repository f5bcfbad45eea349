"""Trace replay: N teacher models replay a frozen trace; where they agree against the
student, a DPO pair.

    states (TraceState) --replay_trace--> rows (TeacherCallResult)
        --extract_dpo_pairs--> DPOPair --save_pairs--> JSONL

Modules: `records` (the TypedDicts, `DEFAULT_TEACHERS`), `budget` (the hard spend cap),
`client` (one call with retries), `cache` (durable row cache), `replay` (`replay_trace`),
`pairs` (`extract_dpo_pairs`, JSONL I/O). httpx is imported only when calls are made.
"""

from __future__ import annotations

from composer_replication.traces.teacher_replay.budget import SpendBudget, prompt_token_upper_bound
from composer_replication.traces.teacher_replay.cache import ReplayCache, cache_key
from composer_replication.traces.teacher_replay.client import RetryPolicy, parse_retry_after
from composer_replication.traces.teacher_replay.pairs import (
    extract_dpo_pairs,
    normalize_action,
    read_jsonl,
    save_pairs,
    strip_thinking,
    write_jsonl,
)
from composer_replication.traces.teacher_replay.records import (
    DEFAULT_TEACHERS,
    OPENROUTER_API_KEY_ENV,
    OPENROUTER_BASE_URL,
    ChatMessage,
    DPOPair,
    ErrorSite,
    StateSource,
    TeacherCallResult,
    TeacherSpec,
    TraceState,
    error_kind,
)
from composer_replication.traces.teacher_replay.replay import (
    ReplayProgress,
    ReplayResults,
    ReplaySummary,
    replay_trace,
)

__all__ = [
    "DEFAULT_TEACHERS",
    "OPENROUTER_API_KEY_ENV",
    "OPENROUTER_BASE_URL",
    "ChatMessage",
    "DPOPair",
    "ErrorSite",
    "ReplayCache",
    "ReplayProgress",
    "ReplayResults",
    "ReplaySummary",
    "RetryPolicy",
    "SpendBudget",
    "StateSource",
    "TeacherCallResult",
    "TeacherSpec",
    "TraceState",
    "cache_key",
    "error_kind",
    "extract_dpo_pairs",
    "normalize_action",
    "parse_retry_after",
    "prompt_token_upper_bound",
    "read_jsonl",
    "replay_trace",
    "save_pairs",
    "strip_thinking",
    "write_jsonl",
]
