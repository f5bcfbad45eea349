"""Ingest Claude Code session files into `TraceState`s: one state per assistant turn.

Claude Code writes `~/.claude/projects/<project>/<session>.jsonl`, one JSON record per line.
Records of `type` "user" and "assistant" carry `message` (`role`, `content`), plus `uuid`,
`parentUuid`, `sessionId`, `isSidechain`, `cwd`, `version` and `timestamp`. A streamed
assistant message is written as several records (one per content block: thinking, text,
tool_use) sharing `message.id`; they form ONE turn, even when tool results are written
between them. Tool results come back as "user" records whose content holds `tool_result`
blocks (`tool_use_id`, `content` string or block list, optional `is_error`).

How records are handled (each skip is counted in `IngestionStats`, never raised):
- "summary", "file-history-snapshot": skipped. "system": skipped, except a
  `compact_boundary`, which clears the history (after a compaction the model saw only the
  summary that follows it). Other known bookkeeping types ("queue-operation", "progress")
  and `isMeta` user records, synthetic assistant messages (`model == "<synthetic>"`) and
  repeated `uuid`s: skipped as "other". Unknown types: skipped, and a warning.
- sidechain records (`isSidechain`) and `agent-*.jsonl` subagent files: skipped when
  `skip_sidechain`. When kept, an agent file is a conversation of its own, and sidechain
  records inside a main file (older versions) form one separate history, never mixed into
  the main one.
- lines that are not UTF-8, not JSON, not an object, or miss the fields a record needs:
  skipped as malformed; an unterminated last line that does not parse (a session still being
  written) counts as truncated.
- rewinds: a user prompt whose parent already had a prompt (an edited or rewound message)
  cuts the history back to that point, so each state sees only its own branch.
- a Claude Code `version` outside the tested range adds a warning (parsed best-effort).

The rendering of blocks into chat text is documented in `ingestion.render`. The state after
a failing tool result (is_error, or an error text classified by
`hint_generator.classify_error`) carries `error_site`, for the SDPO channel's hints.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_replication.traces.ingestion.history import (
    Entry,
    TokenCounter,
    estimate_tokens,
    merge_entries,
    truncate_history,
)
from composer_replication.traces.ingestion.render import (
    render_assistant_blocks,
    render_tool_result,
    tool_result_error,
    tool_result_text,
    user_text,
)
from composer_replication.traces.ingestion.stats import (
    KNOWN_VERSION_RANGE,
    IngestionStats,
    version_warning,
)
from composer_replication.traces.teacher_replay.records import ErrorSite, StateSource, TraceState

#: A record line longer than this (bytes) is skipped and counted, not parsed.
MAX_LINE_BYTES = 64 * 1024 * 1024

__all__ = ["KNOWN_VERSION_RANGE", "SYSTEM_PROMPT", "ClaudeCodeIngester", "IngestionStats"]

SYSTEM_PROMPT = """\
You are a senior software engineer working as a coding agent in a terminal environment, \
inside a user's code repository, with tools (for example Bash, Read, Edit, Write, Glob, \
Grep). The conversation so far is a real coding session. In it, a tool call is written as

<tool_call>{"name": "TOOL_NAME", "arguments": {"argument": "value"}}</tool_call>

(one JSON object: the tool's name and an object of arguments) and the tool's output comes \
back in the next user message as

<tool_result name="TOOL_NAME">
output
</tool_result>

with error="true" added when the tool failed. Reply with your next turn only: at most a \
short message to the user, then the tool calls you would make now, each in exactly the \
format above. Do not write tool results yourself and do not repeat earlier turns."""

_BOOKKEEPING_TYPES = frozenset({"queue-operation", "progress"})


@dataclass
class _Turn:
    message_id: str
    blocks: list[dict[str, Any]]
    error_site: ErrorSite | None
    record: dict[str, Any]


@dataclass
class _Chain:
    """One conversation's history while reading (the main chain, or the sidechain)."""

    entries: list[Entry] = field(default_factory=list)
    turn: _Turn | None = None
    pending_results: list[tuple[Entry, ErrorSite | None]] = field(default_factory=list)
    next_error: ErrorSite | None = None
    prompt_parent_pos: dict[str, int] = field(default_factory=dict)


@dataclass
class _Session:
    """Mutable state while reading one file."""

    path: Path
    main: _Chain = field(default_factory=_Chain)
    # Sidechain records inside a main file (older versions) form their own history.
    side: _Chain = field(default_factory=_Chain)
    tool_names: dict[str, str] = field(default_factory=dict)
    seen_uuids: set[str] = field(default_factory=set)
    versions_warned: set[str] = field(default_factory=set)
    unknown_types: set[str] = field(default_factory=set)
    n_emitted: int = 0


class ClaudeCodeIngester:
    """Reads Claude Code session files into `TraceState`s (see the module docstring).

    Args:
        system_prompt: the prompt put at `messages[0]` of every state.
        skip_sidechain: skip subagent records and `agent-*.jsonl` files.
        strip_thinking: drop thinking blocks from the history (never from `student_action`).
        max_history_tokens: budget for a state's context (system prompt included); the oldest
            history is dropped to fit (see `ingestion.history`). None: no limit.
        token_counter: tokens of a text for that budget; default `estimate_tokens`, or
            `hf_token_counter(tokenizer)` for a real tokenizer.
    """

    def __init__(
        self,
        *,
        system_prompt: str = SYSTEM_PROMPT,
        skip_sidechain: bool = True,
        strip_thinking: bool = True,
        max_history_tokens: int | None = None,
        token_counter: TokenCounter | None = None,
    ) -> None:
        if max_history_tokens is not None and (
            not isinstance(max_history_tokens, int) or max_history_tokens < 1
        ):
            raise ValueError(
                f"max_history_tokens={max_history_tokens!r} must be None or an int >= 1"
            )
        self.system_prompt = system_prompt
        self.skip_sidechain = skip_sidechain
        self.strip_thinking = strip_thinking
        self.max_history_tokens = max_history_tokens
        self.count_tokens = token_counter or estimate_tokens
        self._system_tokens = self.count_tokens(system_prompt)
        self.last_stats = IngestionStats()

    def ingest(self, path: str | Path) -> Iterator[TraceState]:
        """States from a session file, a project folder, or all of `~/.claude/projects`.

        `last_stats` is replaced now and filled while the iterator is consumed.
        """
        root = Path(path).expanduser()
        if not root.exists():
            raise FileNotFoundError(
                f"{str(root)!r} does not exist; pass a session .jsonl file or a folder of them "
                "(e.g. ~/.claude/projects)"
            )
        self.last_stats = IngestionStats()
        return self._ingest(root, self.last_stats)

    def _ingest(self, root: Path, stats: IngestionStats) -> Iterator[TraceState]:
        if root.is_file():
            files = [root]
        else:
            files = sorted(p for p in root.rglob("*.jsonl") if p.is_file())
            if self.skip_sidechain:
                agents = [p for p in files if p.name.startswith("agent-")]
                stats.skipped_subagent_files += len(agents)
                files = [p for p in files if not p.name.startswith("agent-")]
            if not files:
                stats.warnings.append(f"{root}: no session files (*.jsonl) found")
        for file in files:
            if self.skip_sidechain and root.is_file() and file.name.startswith("agent-"):
                stats.skipped_subagent_files += 1
                stats.warnings.append(f"{file}: subagent file skipped (skip_sidechain=True)")
                continue
            yield from self._ingest_file(file, stats)

    # ------------------------------------------------------------------ one file

    def _ingest_file(self, path: Path, stats: IngestionStats) -> Iterator[TraceState]:
        stats.n_files += 1
        try:
            data = path.read_bytes()
        except OSError as exc:
            stats.warnings.append(f"{path}: unreadable ({exc.strerror or exc}); skipped")
            return
        if not data.strip():
            stats.warnings.append(f"{path}: empty file")
            return
        session = _Session(path=path)
        lines = data.split(b"\n")
        unterminated_last = not data.endswith(b"\n")
        for lineno, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            stats.n_records_total += 1
            is_last = lineno == len(lines)
            record = self._parse_line(raw, is_last and unterminated_last, stats)
            if record is not None:
                yield from self._handle(record, session, stats)
        yield from self._flush(session, session.main, stats)
        yield from self._flush(session, session.side, stats)
        if session.unknown_types:
            stats.warnings.append(
                f"{path}: unknown record types {sorted(session.unknown_types)} skipped"
            )

    def _parse_line(
        self, raw: bytes, maybe_truncated: bool, stats: IngestionStats
    ) -> dict[str, Any] | None:
        if len(raw) > MAX_LINE_BYTES:
            stats.skip("skipped_oversized_lines")
            return None
        try:
            record = json.loads(raw.decode("utf-8"))
        except RecursionError:  # nested deeper than the parser goes: skipped, counted
            stats.skip("skipped_oversized_lines")
            return None
        except UnicodeDecodeError:
            stats.skip("skipped_malformed_lines")
            return None
        except json.JSONDecodeError:
            stats.skip("skipped_truncated_lines" if maybe_truncated else "skipped_malformed_lines")
            return None
        if not isinstance(record, dict):
            stats.skip("skipped_malformed_lines")
            return None
        return record

    def _handle(
        self, record: dict[str, Any], session: _Session, stats: IngestionStats
    ) -> Iterator[TraceState]:
        kind = record.get("type")
        version = record.get("version")
        if version is not None and not isinstance(version, str):
            version = json.dumps(version)  # malformed, but must not break the set below
        if version is not None and version not in session.versions_warned:
            session.versions_warned.add(version)
            warning = version_warning(session.path.name, version)
            if warning:
                stats.version_warnings.append(warning)
        uuid = record.get("uuid")
        if isinstance(uuid, str):
            if uuid in session.seen_uuids:
                stats.skip("skipped_other")
                return
            session.seen_uuids.add(uuid)
        sidechain = record.get("isSidechain") is True
        chain = session.side if sidechain else session.main
        if sidechain and self.skip_sidechain:
            stats.skip("skipped_subagent")
        elif kind == "summary":
            stats.skip("skipped_summary")
        elif kind == "file-history-snapshot":
            stats.skip("skipped_snapshot")
        elif kind == "system":
            if record.get("subtype") == "compact_boundary":
                yield from self._flush(session, chain, stats)
                chain.entries.clear()
                chain.next_error = None
                chain.prompt_parent_pos.clear()
                stats.n_compact_boundaries += 1
            else:
                stats.skip("skipped_other")
        elif kind == "assistant":
            yield from self._assistant(record, session, chain, stats)
        elif kind == "user":
            yield from self._user(record, session, chain, stats)
        elif kind in _BOOKKEEPING_TYPES:
            stats.skip("skipped_other")
        else:
            session.unknown_types.add(str(kind))
            stats.skip("skipped_unknown_type")

    def _assistant(
        self, record: dict[str, Any], session: _Session, chain: _Chain, stats: IngestionStats
    ) -> Iterator[TraceState]:
        message = record.get("message")
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
            stats.skip("skipped_malformed_lines")
            return
        if message.get("model") == "<synthetic>":
            stats.skip("skipped_other")
            return
        message_id = message.get("id") or record.get("requestId") or record.get("uuid")
        turn = chain.turn
        if turn is None or message_id is None or turn.message_id != message_id:
            yield from self._flush(session, chain, stats)
            turn = _Turn(str(message_id), [], chain.next_error, record)
            chain.next_error = None
            chain.turn = turn
            stats.n_assistant_turns += 1
        for block in content:
            kind = block.get("type")
            stats.n_text_blocks += kind == "text"
            stats.n_thinking_blocks += kind in ("thinking", "redacted_thinking")
            if kind == "tool_use":
                stats.n_tool_use_blocks += 1
                if isinstance(block.get("id"), str):
                    session.tool_names[block["id"]] = str(block.get("name", ""))
            turn.blocks.append(block)

    def _user(
        self, record: dict[str, Any], session: _Session, chain: _Chain, stats: IngestionStats
    ) -> Iterator[TraceState]:
        message = record.get("message")
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, str | list):
            stats.skip("skipped_malformed_lines")
            return
        if record.get("isMeta") is True:
            stats.skip("skipped_other")
            return
        results = [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]
        if results:
            for block in results:
                entry, error = self._tool_result(block, session, stats)
                if chain.turn is not None:  # belongs after the open turn
                    chain.pending_results.append((entry, error))
                else:
                    chain.entries.append(entry)
                    chain.next_error = error or chain.next_error
        text = user_text(content)
        if not text.strip():
            if not results:
                stats.skip("skipped_other")
            return
        # A user prompt: it closes the open turn and starts a new exchange.
        yield from self._flush(session, chain, stats)
        chain.next_error = None
        parent = record.get("parentUuid")
        if isinstance(parent, str):
            pos = chain.prompt_parent_pos.get(parent)
            if pos is not None and pos < len(chain.entries):
                del chain.entries[pos:]  # a rewind: this prompt replaces a sibling
                stats.n_rewinds += 1
            chain.prompt_parent_pos[parent] = len(chain.entries)
        chain.entries.append(Entry("user", text, self.count_tokens(text)))

    def _tool_result(
        self, block: dict[str, Any], session: _Session, stats: IngestionStats
    ) -> tuple[Entry, ErrorSite | None]:
        stats.n_tool_results += 1
        name = session.tool_names.get(str(block.get("tool_use_id")))
        is_error = block.get("is_error") is True
        text = tool_result_text(block.get("content"))
        rendered = render_tool_result(name, text, is_error=is_error)
        error = tool_result_error(name, text, is_error=is_error)
        return Entry("user", rendered, self.count_tokens(rendered)), error

    def _flush(
        self, session: _Session, chain: _Chain, stats: IngestionStats
    ) -> Iterator[TraceState]:
        """Close the open turn: emit its state, then add it and its results to the history."""
        turn = chain.turn
        if turn is None:
            return
        chain.turn = None
        action = render_assistant_blocks(turn.blocks, keep_thinking=True)
        if action.strip():
            yield self._state(session, chain, turn, action, stats)
        history_text = render_assistant_blocks(turn.blocks, keep_thinking=not self.strip_thinking)
        if history_text.strip():
            chain.entries.append(Entry("assistant", history_text, self.count_tokens(history_text)))
        errors = [error for _, error in chain.pending_results if error is not None]
        chain.entries.extend(entry for entry, _ in chain.pending_results)
        chain.next_error = errors[-1] if errors else None  # the next turn follows these
        chain.pending_results.clear()

    def _state(
        self, session: _Session, chain: _Chain, turn: _Turn, action: str, stats: IngestionStats
    ) -> TraceState:
        entries, dropped = truncate_history(
            chain.entries, self._system_tokens, self.max_history_tokens
        )
        stats.n_truncated_states += dropped > 0
        record = turn.record
        state = TraceState(
            state_id=f"{session.path.stem}::{session.n_emitted:04d}",
            messages=merge_entries(self.system_prompt, entries),
            student_action=action,
            source=StateSource(
                path=str(session.path),
                session_id=record.get("sessionId"),
                cwd=record.get("cwd"),
                version=record.get("version"),
                message_id=turn.message_id,
                timestamp=record.get("timestamp"),
                n_history_dropped=dropped,
            ),
        )
        if turn.error_site is not None:
            state["error_site"] = turn.error_site
            stats.n_error_sites += 1
        session.n_emitted += 1
        stats.n_states_emitted += 1
        return state
