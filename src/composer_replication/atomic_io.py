"""Atomic writes: a crash leaves either the old file (directory) or the new one.

Used for model caches, checkpoints, summaries and outputs. A directory is built in a
uniquely named sibling (``<target>.tmp-<pid>-<hex>``) and renamed into place; leftovers of
dead processes are removed on the next write. A file is written to a temporary sibling,
fsynced and renamed (:func:`write_text_atomic`).
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_siblings(target: Path) -> None:
    """Delete `<target>.tmp-<pid>-*` / `<target>.old-<pid>-*` left by processes that died."""
    if not target.parent.is_dir():
        return
    pattern = re.compile(re.escape(target.name) + r"\.(?:tmp|old)-(\d+)-[0-9a-f]+")
    for sibling in target.parent.iterdir():
        m = pattern.fullmatch(sibling.name)
        if m and not _pid_alive(int(m.group(1))):
            shutil.rmtree(sibling, ignore_errors=True)


def build_dir_atomically(target: Path, build: Callable[[Path], None], *, replace: bool) -> Path:
    """Run `build(tmp)` on an empty sibling `tmp` of `target`, then move `tmp` to `target`.

    If `target` already exists: with `replace=True` the old directory is renamed away, the new
    one renamed in, and the old one deleted; with `replace=False` ours is discarded and the
    existing one kept (another process won the race). If `build` raises, nothing is left behind.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_siblings(target)
    token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = target.with_name(f"{target.name}.tmp-{token}")
    tmp.mkdir()
    try:
        build(tmp)
        if not target.exists():
            try:
                os.rename(tmp, target)
                return target
            except OSError:
                if not target.exists():
                    raise
        # target exists: another writer got there first, or we are overwriting a checkpoint.
        if not replace:
            shutil.rmtree(tmp, ignore_errors=True)
            return target
        old = target.with_name(f"{target.name}.old-{token}")
        os.rename(target, old)
        try:
            os.rename(tmp, target)
        except BaseException:
            os.rename(old, target)
            raise
        shutil.rmtree(old, ignore_errors=True)
        return target
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary sibling renamed into place: a reader
    (or a crash) sees the old file or the new one, never a torn one."""
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would make run outputs private to the writer
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
