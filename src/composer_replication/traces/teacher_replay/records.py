"""The typed records that cross the ingestion -> replay -> pairs boundaries.

All are `TypedDict`s (plain JSON-able dicts, so rows stream to and from JSONL unchanged).
The keys of the public record types are required; the extensions are optional
(`NotRequired`), so code written against the spec keeps working.

No ``from __future__ import annotations`` here: on Python 3.11 a ``TypedDict`` reads
``NotRequired`` only from evaluated annotations (``__optional_keys__``).
"""

import sys
from typing import Any, TypedDict

if sys.version_info >= (3, 11):
    from typing import NotRequired
else:  # pragma: no cover - Python 3.10
    from typing_extensions import NotRequired

__all__ = [
    "DEFAULT_TEACHERS",
    "OPENROUTER_API_KEY_ENV",
    "OPENROUTER_BASE_URL",
    "ChatMessage",
    "DPOPair",
    "ErrorSite",
    "StateSource",
    "TeacherCallResult",
    "TeacherSpec",
    "TraceState",
    "error_kind",
]

OPENROUTER_BASE_URL = "https://openrouter.ai/api/v1"
OPENROUTER_API_KEY_ENV = "OPENROUTER_API_KEY"


class ChatMessage(TypedDict):
    """One chat message: `role` is "system", "user" or "assistant"; `content` is text."""

    role: str
    content: str


class ErrorSite(TypedDict):
    """The error a state follows: the last failing tool result before the assistant turn.

    Keys:
        kind: a `hint_generator.HINT_TEMPLATES` key (from `classify_error`; a result flagged
            `is_error` whose text matches no rule counts as "runtime_error").
        message: the tool result's text (what the agent saw).
        tool_name: the tool that failed, or None when the tool_use block was not seen.
        is_error: True when Claude Code flagged the result `is_error`, False when only the
            text showed an error.
    """

    kind: str
    message: str
    tool_name: str | None
    is_error: bool


class StateSource(TypedDict):
    """Where a state came from in the Claude Code session file."""

    path: str
    session_id: str | None
    cwd: str | None
    version: str | None
    message_id: str | None
    timestamp: str | None
    n_history_dropped: int


class TraceState(TypedDict):
    """A frozen point of a trace: the context the student saw and what it did next.

    Keys:
        state_id: unique id, `f"{session_file_stem}::{turn_index:04d}"` for ingested traces.
        messages: the chat context, `messages[0]` the system prompt.
        student_action: the student's (trace's) assistant turn, rendered as text.
        error_site: optional; set when the turn directly follows a failing tool result.
        source: optional; provenance in the session file.
    """

    state_id: str
    messages: list[ChatMessage]
    student_action: str
    error_site: NotRequired[ErrorSite]
    source: NotRequired[StateSource]


class TeacherSpec(TypedDict):
    """A teacher model behind an OpenAI-compatible chat-completions endpoint.

    Keys:
        slug: the teacher's name in results; also the `model` sent unless `model` is set.
        input_per_mtok / output_per_mtok: USD per million prompt / completion tokens. The
            budget cap is computed from these, so they must be >= the provider's prices.
        base_url: optional endpoint root (".../v1"); default OpenRouter.
        api_key_env: optional environment variable holding this endpoint's key. Without it,
            an OpenRouter teacher uses `api_key` or `OPENROUTER_API_KEY`, and a teacher with
            its own `base_url` sends `api_key` if given, else no key (local servers).
        model: optional model name sent to the endpoint when it differs from `slug`.
        extra_body: optional fields merged into every request body (e.g. `temperature`,
            `reasoning`); part of the cache key.
    """

    slug: str
    input_per_mtok: float
    output_per_mtok: float
    base_url: NotRequired[str]
    api_key_env: NotRequired[str]
    model: NotRequired[str]
    extra_body: NotRequired[dict[str, Any]]


class TeacherCallResult(TypedDict):
    """One (state, teacher) replay outcome. A failure is a row with `error` set.

    Keys:
        response_text: the teacher's message content, None on error.
        latency_s: seconds from the first request to the final outcome (retries included).
        prompt_tokens / completion_tokens: the provider's reported usage (the reservation's
            bounds when the provider reported none).
        cost_usd: what the budget settled for this call, all attempts included (an upper
            bound of what the provider billed; see `SpendBudget`).
        error: None, or `"<kind>: <detail>"` with kind one of "budget_exceeded",
            "http_<status>", "timeout", "connection_error", "malformed_response"
            (see `error_kind`).
        cached: optional; True when served from the on-disk cache (no request this run).
        attempts: optional; HTTP requests made for this row in this run.
    """

    state_id: str
    teacher_slug: str
    response_text: str | None
    latency_s: float
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    error: str | None
    cached: NotRequired[bool]
    attempts: NotRequired[int]


class DPOPair(TypedDict):
    """A preference pair: the teachers' agreed action over the student's."""

    state_id: str
    state_messages: list[ChatMessage]
    chosen: str
    rejected: str
    n_teachers_agreeing: int


# Prices in USD per million tokens. openai/gpt-5 is the spec's list price. The other two are
# the providers' published list prices (Anthropic: Opus 4.7 $5 / $25; DeepSeek: V4-Pro
# $1.74 / $3.48 before its 75% discount). All three are configurable: pass your own
# TeacherSpec list. Prices above what a provider bills only make the cap more conservative.
# A list, as the public API documents it. It is shared module state: never mutate it; copy
# it (`[dict(t) for t in DEFAULT_TEACHERS]`) to derive your own list. Nothing in the package
# mutates it: `replay_trace` works on its own copy of the list it is given and only reads the
# specs, and the trace CLI copies each spec it picks.
DEFAULT_TEACHERS: list[TeacherSpec] = [
    TeacherSpec(slug="anthropic/claude-opus-4.7", input_per_mtok=5.0, output_per_mtok=25.0),
    TeacherSpec(slug="openai/gpt-5", input_per_mtok=1.25, output_per_mtok=10.0),
    TeacherSpec(slug="deepseek/deepseek-v4-pro", input_per_mtok=1.74, output_per_mtok=3.48),
]


def error_kind(error: str | None) -> str | None:
    """The kind prefix of a `TeacherCallResult.error` ("http_429: ..." -> "http_429")."""
    if error is None:
        return None
    return error.split(":", 1)[0].strip()
