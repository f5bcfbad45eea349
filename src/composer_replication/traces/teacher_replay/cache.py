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
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
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
        self._load()
        self._cut_partial_tail()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        # One writer thread: fsync stays off the event loop and lines stay in order.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replay-cache")

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
                    key, row = entry["key"], entry["row"]
                    if not isinstance(key, str) or not isinstance(row, dict):
                        raise TypeError("key/row of the wrong type")
                except (UnicodeDecodeError, ValueError, KeyError, TypeError):
                    self.n_corrupt_lines += 1
                    continue
                self._rows[key] = row  # type: ignore[assignment]

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
        line = json.dumps({"key": key, "row": row}, ensure_ascii=False) + "\n"
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._writer, self._append, line.encode("utf-8"))
        self._rows[key] = row

    def close(self) -> None:
        """Finish pending writes and close the file."""
        self._writer.shutdown(wait=True)
        os.close(self._fd)
