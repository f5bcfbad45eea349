"""Turn teacher agreement into DPO pairs, and read/write the JSONL files of the pipeline.

`extract_dpo_pairs`: per state, the teachers' answers are compared after whitespace
normalisation (every run of whitespace becomes one space, ends stripped); the answer most
teachers gave wins (ties: the one given first in teacher order). A pair is emitted when at
least `agreement_threshold` teachers gave it AND it differs from the student's action. The
student action is compared without its `<thinking>` blocks (teachers are not asked to show
their reasoning, so thinking alone must not make the student "differ"); `rejected` keeps the
student action as it is, `chosen` the winning teacher's original text.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from composer_replication.traces.teacher_replay.records import (
    DPOPair,
    TeacherCallResult,
    TraceState,
)

__all__ = [
    "extract_dpo_pairs",
    "normalize_action",
    "read_jsonl",
    "save_pairs",
    "strip_thinking",
    "write_jsonl",
]

_WHITESPACE_RE = re.compile(r"\s+")
_THINKING_RE = re.compile(r"<thinking>.*?</thinking>", re.DOTALL)


def normalize_action(text: str) -> str:
    """Collapse every whitespace run to one space and strip the ends."""
    return _WHITESPACE_RE.sub(" ", text).strip()


def strip_thinking(text: str) -> str:
    """`text` without its `<thinking>...</thinking>` blocks (the ingester's rendering)."""
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


def write_jsonl(rows: Iterable[Any], path: str | os.PathLike[str]) -> Path:
    """Write rows as JSONL atomically (temp file, fsync, rename); creates parent dirs."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def save_pairs(pairs: Sequence[DPOPair], path: str | os.PathLike[str]) -> Path:
    """Write `pairs` as JSONL (one `DPOPair` per line), atomically, creating parent dirs."""
    return write_jsonl(pairs, path)


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[Any]:
    """Yield the JSON value of each non-blank line; a bad line raises naming its number."""
    source = Path(path)
    if not source.is_file():
        raise FileNotFoundError(f"{str(source)!r} is not a file; pass a JSONL file path")
    with open(source, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{source}:{lineno} is not valid JSON ({exc.msg})") from exc
