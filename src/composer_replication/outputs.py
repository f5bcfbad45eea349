"""One output policy for every command, and the exit codes every command uses.

Before any work starts, an output path is refused (:class:`OutputError`, one line naming
the path and the fix) when it is

- one of the command's inputs (the same resolved path or the same file by inode), or lies
  inside an input folder the command reads;
- an existing directory, device, FIFO or socket (anything but a regular file);
- a symbolic link, unless the command was asked to follow it (then its target is checked
  and written instead);
- in a folder that cannot be created or written.

The file itself is written by :func:`composer_replication.atomic_io.write_lines_atomic`:
into a temporary sibling, renamed into place only when the command produced at least one
record, keeping an existing file's mode; on any failure the old file stays as it was.

The exit codes every command uses are in :mod:`composer_replication.errors`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from composer_replication.errors import UsageError

__all__ = [
    "OutputError",
    "check_output",
    "check_output_dir",
    "file_kind",
]


class OutputError(UsageError):
    """An output path the policy refuses."""


def file_kind(mode: int) -> str:
    """What a ``stat`` mode is, in words ("a regular file", "a FIFO", ...)."""
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "a special file"


def _same_file(a: Path, b: Path) -> bool:
    try:
        if a.resolve() == b.resolve():
            return True
        return os.path.samefile(a, b)  # hard links, bind mounts: the same inode
    except OSError:
        return False


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
    except ValueError:
        return False
    return True


def _check_folder(target: Path, shown: str) -> None:
    """The nearest existing ancestor of ``target`` must be a writable directory."""
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        if parent.is_symlink():  # a dangling link in the way: mkdir would fail later
            break
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"cannot write {shown}: {str(parent)!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {shown}: {str(parent)!r} is not writable")


def check_output(
    path: str | os.PathLike[str],
    *,
    inputs: Iterable[str | os.PathLike[str]] = (),
    input_dirs: Iterable[str | os.PathLike[str]] = (),
    follow_symlinks: bool = False,
    option: str = "-o",
) -> Path:
    """The file to write for the output ``path``, or :class:`OutputError` (see the module).

    ``inputs`` are files the command reads, ``input_dirs`` folders it reads every file
    of; ``option`` names the flag in messages. Returns the path to write: ``path`` itself,
    or a followed link's target.
    """
    given = Path(path).expanduser()
    shown = repr(str(path))
    target = given
    if given.is_symlink():
        if not follow_symlinks:
            raise OutputError(
                f"output {shown} is a symbolic link; pass the file it points to, or "
                "--follow-symlinks to write through it"
            )
        target = given.resolve()
    try:
        st = target.stat()
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        raise OutputError(f"cannot write {shown}: a part of its folder is a file") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise OutputError(f"output {shown} is a directory; pass a file path ({option} DIR/name)")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise OutputError(
            f"output {shown} is {file_kind(st.st_mode)}, not a regular file; pass a file path"
        )
    for source in inputs:
        if _same_file(target, Path(source)):
            raise OutputError(
                f"output {shown} is the input {str(source)!r}; writing it would destroy what "
                f"is read: pass another {option}"
            )
    for folder in input_dirs:
        if Path(folder).is_dir() and _inside(target, Path(folder)):
            raise OutputError(
                f"output {shown} is inside the input folder {str(folder)!r}, which is read "
                f"whole; pass an {option} outside it"
            )
    _check_folder(target, shown)
    return target


def check_output_dir(path: str | os.PathLike[str], *, option: str = "--output-dir") -> Path:
    """An output directory: absent (then its folder must be writable) or a writable
    directory; a file, a device or an unwritable directory is an :class:`OutputError`."""
    target = Path(path).expanduser()
    shown = repr(str(path))
    try:
        st = target.stat()
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        raise OutputError(
            f"{option} {shown}: a part of its path is a file; pass a directory path"
        ) from None
    if st is None:
        _check_folder(target, f"{option} {shown}")
    elif not stat.S_ISDIR(st.st_mode):
        raise OutputError(
            f"{option} {shown} is {file_kind(st.st_mode)}, not a directory; pass a directory path"
        )
    elif not os.access(target, os.W_OK | os.X_OK):
        raise OutputError(f"{option} {shown} is not writable; pass a directory you can write")
    return target
