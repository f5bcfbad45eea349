"""Turn teacher agreement into DPO pairs, and read/write the JSONL files of the pipeline.

`extract_dpo_pairs`: per state, the teachers' answers are compared after whitespace
normalisation (every run of whitespace becomes one space, ends stripped); the answer most
teachers gave wins (ties: the one given first in teacher order). A pair is emitted when at
least `agreement_threshold` teachers gave it AND it differs from the student's action. The
student action is compared without its `[THINKING]` blocks (teachers are not asked to show
their reasoning, so thinking alone must not make the student "differ"); `rejected` keeps the
student action as it is, `chosen` the winning teacher's original text.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from composer_replication.common.atomic_io import EmptyOutputError
from composer_replication.traces.teacher_replay.records import (
    DPOPair,
    TeacherCallResult,
    TraceState,
)

__all__ = [
    "EmptyOutputError",
    "check_output_path",
    "extract_dpo_pairs",
    "normalize_action",
    "read_jsonl",
    "save_pairs",
    "strip_thinking",
    "write_jsonl",
]

_WHITESPACE_RE = re.compile(r"\s+")
# The ingester's `[THINKING]...[/THINKING]` blocks, and the `<thinking>` form of older traces.
_THINKING_RE = re.compile(r"\[THINKING\].*?\[/THINKING\]|<thinking>.*?</thinking>", re.DOTALL)


def normalize_action(text: str) -> str:
    """Collapse every whitespace run to one space and strip the ends."""
    return _WHITESPACE_RE.sub(" ", text).strip()


def strip_thinking(text: str) -> str:
    """`text` without its `[THINKING]...[/THINKING]` blocks (the ingester's rendering; the
    `<thinking>...</thinking>` form of older traces too)."""
    return _THINKING_RE.sub("", text)


def extract_dpo_pairs(
    states: Iterable[TraceState],
    teacher_actions: Iterable[TeacherCallResult],
    agreement_threshold: int = 2,
) -> list[DPOPair]:
    """At most one pair per state, in state order (see the module docstring).

    Rows with an `error` or no `response_text` do not vote; rows of unknown states are
    ignored.
    """
    if (
        not isinstance(agreement_threshold, int)
        or isinstance(agreement_threshold, bool)
        or agreement_threshold < 1
    ):
        raise ValueError(f"agreement_threshold={agreement_threshold!r} must be an int >= 1")
    by_state: dict[str, list[str]] = {}
    for row in teacher_actions:
        text = row.get("response_text")
        if row.get("error") is None and isinstance(text, str):
            by_state.setdefault(row["state_id"], []).append(text)
    pairs: list[DPOPair] = []
    for state in states:
        answers = by_state.get(state["state_id"], [])
        votes: dict[str, list[str]] = {}  # normalised -> original texts, first-seen order
        for text in answers:
            votes.setdefault(normalize_action(text), []).append(text)
        if not votes:
            continue
        winner = max(votes, key=lambda k: len(votes[k]))  # max keeps the first of ties
        n_agree = len(votes[winner])
        student = normalize_action(strip_thinking(state["student_action"]))
        if n_agree < agreement_threshold or not winner or winner == student:
            continue
        pairs.append(
            DPOPair(
                state_id=state["state_id"],
                state_messages=list(state["messages"]),
                chosen=votes[winner][0],
                rejected=state["student_action"],
                n_teachers_agreeing=n_agree,
            )
        )
    return pairs


def write_jsonl(
    rows: Iterable[Any],
    path: str | os.PathLike[str],
    *,
    require_rows: bool = False,
    inputs: Iterable[str | os.PathLike[str]] = (),
) -> Path:
    """Write rows as JSONL atomically (temp file, fsync, rename); creates parent dirs.

    The output policy of :func:`check_output_path` applies (``inputs``: files the rows are
    read from). The target is replaced only when everything was written, keeping its mode;
    with ``require_rows`` an empty result raises :class:`EmptyOutputError` and leaves an
    existing file as it was.
    """
    from composer_replication.common.atomic_io import write_lines_atomic

    target = check_output_path(path, inputs=inputs)
    lines = (json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    write_lines_atomic(target, lines, require_lines=require_rows)
    return target


def check_output_path(
    path: str | os.PathLike[str], *, inputs: Iterable[str | os.PathLike[str]] = ()
) -> Path:
    """``path`` as an output file (:func:`composer_replication.common.outputs.check_output`): not
    an input, not a directory, device, FIFO or link, and its folder creatable and writable.

    Call it before any paid work, so a bad ``-o`` fails at once, not after the spend.
    """
    from composer_replication.common.outputs import check_output

    return check_output(path, inputs=inputs)


def save_pairs(pairs: Sequence[DPOPair], path: str | os.PathLike[str]) -> Path:
    """Write `pairs` as JSONL (one `DPOPair` per line), atomically, creating parent dirs."""
    return write_jsonl(pairs, path)


def read_jsonl(
    path: str | os.PathLike[str],
    *,
    skipped: dict[str, int] | None = None,
    max_line_bytes: int = 64 * 1024 * 1024,
) -> Iterator[Any]:
    """Yield the JSON value of each non-blank line.

    Without ``skipped`` a bad line raises ``ValueError`` naming its number. With it, bad
    lines are skipped and counted there instead: ``malformed`` (not JSON, not UTF-8),
    ``too_deep`` (nested past the parser's limit) and ``oversized`` (over ``max_line_bytes``).
    """
    source = Path(path)
    if not source.is_file():
        raise FileNotFoundError(f"{str(source)!r} is not a file; pass a JSONL file path")

    def bad(kind: str, lineno: int, detail: str) -> None:
        if skipped is None:
            raise ValueError(f"{source}:{lineno} is not valid JSON ({detail})")
        skipped[kind] = skipped.get(kind, 0) + 1

    with open(source, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            if len(raw) > max_line_bytes:
                bad("oversized", lineno, f"a line of {len(raw)} bytes")
                continue
            try:
                yield json.loads(raw.decode("utf-8"))
            except RecursionError:
                bad("too_deep", lineno, "nested too deeply")
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                bad("malformed", lineno, getattr(exc, "msg", str(exc)))
