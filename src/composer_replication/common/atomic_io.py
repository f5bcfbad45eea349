"""Atomic writes: a crash leaves either the old file (directory) or the new one.

Used for model caches, checkpoints, summaries and outputs. A directory is built in a
uniquely named sibling (``<target>.tmp-<pid>-<hex>``) and renamed into place; leftovers of
dead processes are removed on the next write. A file is written to a temporary sibling,
fsynced and renamed (:func:`write_lines_atomic`, :func:`write_text_atomic`); only a regular
file is ever replaced, and it keeps its mode.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

from composer_replication.common.pids import pid_alive


def _remove_stale_siblings(target: Path) -> None:
    """Delete `<target>.tmp-<pid>-*` / `<target>.old-<pid>-*` left by processes that died."""
    if not target.parent.is_dir():
        return
    pattern = re.compile(re.escape(target.name) + r"\.(?:tmp|old)-(\d+)-[0-9a-f]+")
    for sibling in target.parent.iterdir():
        m = pattern.fullmatch(sibling.name)
        if m and not pid_alive(int(m.group(1))):
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


class EmptyOutputError(ValueError):
    """Nothing to write: the existing output file (if any) was left untouched."""


def _replaceable(path: Path) -> os.stat_result | None:
    """The ``lstat`` of the regular file at ``path`` (None when there is none); anything
    else there (a link, a directory, a device, a FIFO) is refused, never replaced."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        from composer_replication.common.outputs import OutputError, file_kind

        raise OutputError(
            f"{str(path)!r} is {file_kind(st.st_mode)}, not a regular file: not replaced"
        )
    return st


def write_lines_atomic(
    path: str | Path,
    lines: Iterable[str],
    *,
    require_lines: bool = False,
    mode: int | None = None,
) -> int:
    """Write ``lines`` (each already ending in a newline, or not) to ``path`` through a
    temporary sibling renamed into place; return how many were written.

    A reader (or a crash) sees the old file or the new one, never a torn one. Only a regular
    file is replaced: a link, directory, device or FIFO at ``path`` raises
    :class:`~composer_replication.common.outputs.OutputError` before and after the writing.
    ``mode``: the new file's permission bits; default: the replaced file's, else 0o644.
    With ``require_lines`` no line raises :class:`EmptyOutputError` and keeps the old file.
    """
    import tempfile

    path = Path(path)
    _replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    count = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            for line in lines:
                fh.write(line)
                count += 1
            fh.flush()
            os.fsync(fh.fileno())
        if require_lines and count == 0:
            raise EmptyOutputError(f"nothing to write to {str(path)!r}; it was left untouched")
        old = _replaceable(path)  # checked again: something may have appeared meanwhile
        if mode is None:
            # mkstemp's 0600 would make outputs private; an existing file keeps its mode
            mode = stat.S_IMODE(old.st_mode) if old is not None else 0o644
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return count


def write_text_atomic(path: str | Path, text: str, *, mode: int | None = None) -> Path:
    """Write ``text`` to ``path`` atomically (:func:`write_lines_atomic`): the old file or
    the new one, a regular file only, an existing file's mode kept."""
    write_lines_atomic(path, [text], mode=mode)
    return Path(path)
