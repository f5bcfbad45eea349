"""Reading files a candidate could have tampered with, without ever blocking.

A candidate can leave a FIFO, a device node or a symlink where a grader expects a file:
``open()`` on a FIFO blocks until a writer appears (forever, after the sandbox is gone), and
a symlink can point anywhere on the host. Everything here looks with ``lstat`` first, reads
regular files only, opens them non-blocking and without following links, and checks that
the file opened is the one looked at.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["file_kind", "mode_kind", "read_regular_file"]


def file_kind(path: Path) -> str:
    """ "file", "dir", "link", "fifo", "socket", "device" or "missing" (by ``lstat``)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "missing"
    return mode_kind(mode)


def mode_kind(mode: int) -> str:
    """ "file", "dir", "link", "fifo", "socket" or "device": the type an ``st_mode`` names."""
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "device"


def read_regular_file(path: Path, max_bytes: int) -> bytes | None:
    """The file's bytes if it is a regular file of at most ``max_bytes``, else None.

    ``lstat`` first (a symlink, FIFO or device is refused without being opened), then a
    non-blocking, no-follow open whose ``fstat`` must match (no swap in between).
    """
    try:
        before = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(before.st_mode) or before.st_size > max_bytes:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        now = os.fstat(fd)
        if (now.st_ino, now.st_dev) != (before.st_ino, before.st_dev) or not stat.S_ISREG(
            now.st_mode
        ):
            return None
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return None if size > max_bytes else b"".join(chunks)
    finally:
        os.close(fd)
