"""`IngestionStats`, the counters of one ingest call, and the Claude Code version check."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KNOWN_VERSION_RANGE", "IngestionStats", "version_warning"]

# Claude Code versions whose session format this ingester was written against: >= 1.0, < 3.
KNOWN_VERSION_RANGE = ((1, 0, 0), (3, 0, 0))

_VERSION_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)")


def version_warning(file_name: str, version: Any) -> str | None:
    """A warning when `version` is not a tested Claude Code version, else None."""
    m = _VERSION_RE.match(str(version))
    parsed = tuple(int(g) for g in m.groups()) if m else None
    low, high = KNOWN_VERSION_RANGE
    if parsed is not None and low <= parsed < high:
        return None
    return (
        f"{file_name}: Claude Code version {version!r} is outside the tested range "
        f">= {'.'.join(map(str, low))}, < {'.'.join(map(str, high))}; parsed best-effort"
    )


@dataclass
class IngestionStats:
    """Counters of one `ingest` call.

    `n_records_total` counts non-blank lines; `n_records_skipped` those that added nothing
    to a conversation, and equals the sum of the `skipped_*` record counters.
    """

    n_records_total: int = 0
    n_records_skipped: int = 0
    n_states_emitted: int = 0
    n_assistant_turns: int = 0
    n_tool_use_blocks: int = 0
    n_text_blocks: int = 0
    skipped_subagent: int = 0
    skipped_summary: int = 0
    skipped_truncated_lines: int = 0
    version_warnings: list[str] = field(default_factory=list)
    # Extensions beyond the spec's counters.
    n_files: int = 0
    n_thinking_blocks: int = 0
    n_tool_results: int = 0
    n_error_sites: int = 0
    n_compact_boundaries: int = 0
    n_rewinds: int = 0
    n_truncated_states: int = 0
    skipped_snapshot: int = 0
    skipped_malformed_lines: int = 0
    skipped_unknown_type: int = 0
    skipped_other: int = 0
    skipped_subagent_files: int = 0
    skipped_oversized_lines: int = 0
    warnings: list[str] = field(default_factory=list)

    def skip(self, reason: str) -> None:
        setattr(self, reason, getattr(self, reason) + 1)
        self.n_records_skipped += 1
