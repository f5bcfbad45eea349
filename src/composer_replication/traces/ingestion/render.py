"""The stable textual rendering of Claude Code content blocks in a chat history.

Teachers see the trace as plain chat messages, so tool calls and tool results are rendered
into text, in one fixed form that `SYSTEM_PROMPT` also describes (a teacher can answer in
the same form, which makes teacher and student actions comparable):

Assistant turn, blocks in their original order, separated by one blank line:

    [THINKING]
    {thinking text}
    [/THINKING]

    {text block, verbatim}

    <tool_call>{"name": "{tool name}", "arguments": {input as JSON: keys sorted,
    non-ASCII kept, no indentation}}</tool_call>

    (the project's one tool-call format, ``rollout.tool_calls``: the agent loop writes and
    parses calls the same way, so a replayed action or a DPO pair's side reads as a call)

Tool results, in a user message, one per result in the order they arrived:

    <tool_result name="{tool name}">          (error="true" added when is_error)
    {content: a string verbatim; a block list as its text blocks joined by newlines,
     "[image]" for an image, "[<type>]" for any other block}
    </tool_result>

Tool-use ids are left out on purpose: they are random, so a teacher could never reproduce
them and two identical actions would differ. Results are matched to calls by order and
name. Thinking blocks are kept in the student action and dropped from the history when the
ingester's `strip_thinking` is on; redacted thinking (no text) is dropped everywhere.
Consecutive entries of one role are merged into one message, joined by a blank line.
"""

from __future__ import annotations

import json
from typing import Any

from composer_replication.hint_generator import classify_error
from composer_replication.traces.teacher_replay.records import ErrorSite

__all__ = [
    "CONTENT_TOOLS",
    "THINKING_CLOSE",
    "THINKING_OPEN",
    "render_assistant_blocks",
    "render_tool_call",
    "render_tool_result",
    "tool_result_error",
    "tool_result_text",
    "user_text",
]

# The markers around a thinking block in a rendered assistant turn.
THINKING_OPEN = "[THINKING]"
THINKING_CLOSE = "[/THINKING]"

# Tools whose output is file or web content, not an outcome: an error-looking text in their
# output (a traceback in a file being read) is not an error site unless Claude Code flagged
# the result is_error.
CONTENT_TOOLS = frozenset(
    {"Read", "Glob", "Grep", "LS", "WebFetch", "WebSearch", "NotebookRead", "TodoRead", "TodoWrite"}
)


def _block_placeholder(block: Any) -> str:
    kind = block.get("type") if isinstance(block, dict) else type(block).__name__
    return f"[{kind}]"


def render_tool_call(name: str, tool_input: Any) -> str:
    """A call in the project's tool-call format (``rollout.tool_calls``), arguments' keys
    sorted; input that is not an object is kept under ``"input"``."""
    from composer_replication.rollout.tool_calls import format_tool_call

    arguments = tool_input if isinstance(tool_input, dict) else {"input": tool_input}
    return format_tool_call(name, arguments, sort_keys=True)


def render_assistant_blocks(blocks: list[dict[str, Any]], *, keep_thinking: bool) -> str:
    """One assistant turn as text (see the module docstring)."""
    parts = []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            text = block.get("text")
            if isinstance(text, str) and text.strip():
                parts.append(text)
        elif kind == "thinking":
            thinking = block.get("thinking")
            if keep_thinking and isinstance(thinking, str) and thinking.strip():
                parts.append(f"{THINKING_OPEN}\n{thinking}\n{THINKING_CLOSE}")
        elif kind in ("tool_use", "server_tool_use"):
            parts.append(render_tool_call(str(block.get("name", "")), block.get("input", {})))
        elif kind != "redacted_thinking":
            parts.append(_block_placeholder(block))
    return "\n\n".join(parts)


def tool_result_text(content: Any) -> str:
    """The text of a tool_result's `content` (a string or a list of blocks)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if isinstance(block, dict) and block.get("type") == "text":
                parts.append(str(block.get("text", "")))
            elif isinstance(block, dict) and block.get("type") == "image":
                parts.append("[image]")
            else:
                parts.append(_block_placeholder(block))
        return "\n".join(parts)
    return json.dumps(content, ensure_ascii=False, sort_keys=True)


def render_tool_result(name: str | None, text: str, *, is_error: bool) -> str:
    error = ' error="true"' if is_error else ""
    return f'<tool_result name="{name or "unknown"}"{error}>\n{text}\n</tool_result>'


def tool_result_error(name: str | None, text: str, *, is_error: bool) -> ErrorSite | None:
    """The error site a tool result makes, or None (uses `hint_generator.classify_error`)."""
    kind = classify_error(text)
    if is_error:
        kind = kind or "runtime_error"  # flagged failures with no recognisable text
    elif kind is None or name in CONTENT_TOOLS:
        return None
    return ErrorSite(kind=kind, message=text, tool_name=name, is_error=is_error)


def user_text(content: Any) -> str:
    """The text of a user prompt's content (string or blocks, tool results excluded)."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content if isinstance(content, list) else []:
        if isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif isinstance(block, dict) and block.get("type") == "tool_result":
            continue
        else:
            parts.append(_block_placeholder(block))
    return "\n\n".join(p for p in parts if p.strip())
