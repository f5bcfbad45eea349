"""On-disk cache of finished replay rows, so a re-run never pays twice for a call.

Layout: one file, `<cache_dir>/replay-cache.jsonl`, one `{"key": ..., "row": ...}` line per
finished (state, teacher) call. The key is sha256 over (state_id, teacher slug, base_url,
request body), so changing the prompt, the model, `max_tokens` or `extra_body` misses.

Durability: each line is written with one `os.write` on an `O_APPEND` descriptor and then
`fsync`ed before the row counts as finished, so after a crash or Ctrl-C every finished row
is on disk and at most the line being written is partial. Opening the cache for writing
cuts such a partial last line off, so later appends start on a fresh line; reading skips
lines that do not parse. Only successful rows are stored: failed calls are retried on the
next run. Two runs sharing a cache directory append safely, but may both pay for a call
that neither had finished.

Journal and ledger: a call is journaled (``{"sent": key, "nanos": reservation}``) before its
request goes out and its charge recorded (``{"spent": key, "nanos": charged}``) when it ends,
whatever the outcome; a successful row goes out in that same write. Opening the cache reads
the ledger, the cumulative spend of every run that used it (``prior_spend_nanos``), so a
spend cap holds across runs. A call journaled
but never ended was in flight when a run was killed: the provider may have billed it, so it
is charged at its reservation (written down as ``{"spent": ..., "unknown": true}``) and
listed in ``unknown_keys``; the replay does not send it again unless asked to.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path
from typing import Any

from composer_replication.traces.teacher_replay.records import TeacherCallResult

__all__ = ["CACHE_FILENAME", "ReplayCache", "cache_key"]

CACHE_FILENAME = "replay-cache.jsonl"


def cache_key(state_id: str, teacher_slug: str, base_url: str, body: dict[str, Any]) -> str:
    """sha256 hex digest of the call's identity (canonical JSON, sorted keys)."""
    payload = json.dumps(
        [state_id, teacher_slug, base_url, body],
        sort_keys=True,
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


class ReplayCache:
    """Finished rows by key, loaded from disk; `put` appends durably.

    Attributes:
        path: the JSONL file.
        n_corrupt_lines: lines skipped while loading (partial writes, foreign text).
    """

    def __init__(self, cache_dir: str | os.PathLike[str]) -> None:
        directory = Path(cache_dir)
        if directory.exists() and not directory.is_dir():
            raise NotADirectoryError(
                f"cache_dir={str(directory)!r} is a file; pass a directory (it is created)"
            )
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / CACHE_FILENAME
        self.n_corrupt_lines = 0
        self._rows: dict[str, TeacherCallResult] = {}
        self._sent: dict[str, int] = {}
        self._spent: dict[str, int] = {}
        self.unknown_keys: set[str] = set()
        self._load()
        self._cut_partial_tail()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        # One writer thread: fsync stays off the event loop and lines stay in order.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replay-cache")
        self._settle_dangling()

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, key: str) -> TeacherCallResult | None:
        return self._rows.get(key)

    def _load(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as fh:
            for raw in fh:
                try:
                    entry = json.loads(raw.decode("utf-8"))
                    if "sent" in entry or "spent" in entry:
                        self._journal_entry(entry)
                        continue
                    key, row = entry["key"], entry["row"]
                    if not isinstance(key, str) or not isinstance(row, dict):
                        raise TypeError("key/row of the wrong type")
                except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError):
                    self.n_corrupt_lines += 1
                    continue
                self._rows[key] = row  # type: ignore[assignment]

    def _journal_entry(self, entry: dict[str, Any]) -> None:
        nanos = entry["nanos"]
        if not isinstance(nanos, int) or nanos < 0:
            raise TypeError("a journal entry needs whole nano-dollars >= 0")
        if "sent" in entry:
            self._sent[str(entry["sent"])] = nanos
            return
        key = str(entry["spent"])
        self._spent[key] = self._spent.get(key, 0) + nanos
        self._sent.pop(key, None)
        if entry.get("unknown"):
            self.unknown_keys.add(key)
        else:
            self.unknown_keys.discard(key)

    def _settle_dangling(self) -> None:
        """Charge calls a killed run left in flight at their reservations (fail closed)."""
        for key, nanos in list(self._sent.items()):
            line = json.dumps({"spent": key, "nanos": nanos, "unknown": True}) + "\n"
            self._append(line.encode("utf-8"))
            self._journal_entry({"spent": key, "nanos": nanos, "unknown": True})
        self.unknown_keys -= set(self._rows)

    @property
    def prior_spend_nanos(self) -> int:
        """What every earlier run that used this cache spent (unknown outcomes included)."""
        legacy = sum(
            round(Fraction(repr(float(row.get("cost_usd") or 0.0))) * 10**9)
            for key, row in self._rows.items()
            if key not in self._spent
        )
        return sum(self._spent.values()) + legacy

    async def journal_sent(self, key: str, nanos: int) -> None:
        """Record (durably) that the call ``key`` is about to be sent."""
        await self._write({"sent": key, "nanos": int(nanos)})
        self._sent[key] = int(nanos)

    async def journal_spent(
        self, key: str, nanos: int, row: TeacherCallResult | None = None
    ) -> None:
        """Record (durably) what the call ``key`` was charged when it ended, and its row.

        A successful ``row`` goes out in the same write as the charge, so a run cancelled
        at any point leaves either both on disk or neither (then the call counts as in
        flight): a charged answer is never lost and paid for again.
        """
        charge = {"spent": key, "nanos": int(nanos)}
        await self._write(charge, *([] if row is None else [{"key": key, "row": row}]))
        self._journal_entry({"spent": key, "nanos": int(nanos)})
        if row is not None:
            self._rows[key] = row

    async def _write(self, *entries: dict[str, Any]) -> None:
        """Append ``entries`` as lines in one write (all on disk after a cancel, or none)."""
        lines = "".join(json.dumps(entry, ensure_ascii=False) + "\n" for entry in entries)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._writer, self._append, lines.encode("utf-8"))

    def _cut_partial_tail(self) -> None:
        """Drop an unterminated last line (a write cut by a crash)."""
        if not self.path.exists():
            return
        with open(self.path, "rb+") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            if size == 0:
                return
            fh.seek(size - 1)
            if fh.read(1) == b"\n":
                return
            # Walk back to the last newline; the file is small relative to memory per block.
            block = 65536
            pos = size
            while pos > 0:
                start = max(0, pos - block)
                fh.seek(start)
                chunk = fh.read(pos - start)
                idx = chunk.rfind(b"\n")
                if idx >= 0:
                    fh.truncate(start + idx + 1)
                    return
                pos = start
            fh.truncate(0)

    def _append(self, line: bytes) -> None:
        view = memoryview(line)
        while view:  # a regular-file write is whole in practice; loop in case it is not
            view = view[os.write(self._fd, view) :]
        os.fsync(self._fd)

    async def put(self, key: str, row: TeacherCallResult) -> None:
        """Store `row` durably (returns after fsync)."""
        await self._write({"key": key, "row": row})
        self._rows[key] = row

    def close(self) -> None:
        """Finish pending writes and close the file."""
        self._writer.shutdown(wait=True)
        os.close(self._fd)
