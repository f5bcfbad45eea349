"""One output policy for every command, and the exit codes every command uses.

Before any work starts, an output path is refused (:class:`OutputError`, one line naming
the path and the fix) when it is

- one of the command's inputs (the same resolved path or the same file by inode), or lies
  inside an input folder the command reads;
- an existing directory, device, FIFO or socket (anything but a regular file);
- a symbolic link, unless the command was asked to follow it (then its target is checked
  and written instead);
- in a folder that cannot be created or written;
- a file another command keeps (:func:`owner_of`): the teacher-replay cache, the project's
  cache (converted models, generated tasks), a run's record (its config, metrics,
  checkpoints, final model, report, rollouts, lock), a task generation's outputs, or the
  project's own source; a command may name the kinds it owns itself (``owns``: datagen
  rewrites its own task files).

The file itself is written by :func:`composer_replication.common.atomic_io.write_lines_atomic`:
into a temporary sibling, renamed into place only when the command produced at least one
record, keeping an existing file's mode; on any failure the old file stays as it was.

The exit codes every command uses are in :mod:`composer_replication.common.errors`.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

from composer_replication.common.errors import UsageError, shortened

__all__ = [
    "OUTPUT_MARKER",
    "OWNED_KINDS",
    "OutputError",
    "check_output",
    "check_output_dir",
    "file_kind",
    "is_generation_output",
    "owner_of",
]

#: the kinds of file :func:`owner_of` knows
OWNED_KINDS = ("replay_cache", "project_cache", "run_record", "task_generation", "source")
# the entries of a run directory that are its record (training.run_record's RUN_RECORD, the
# rollouts, the records set aside, the lock): kept here as names, so this stays light
_RUN_ENTRIES = (
    "config.json", "metrics.jsonl", "summary.json", "report", "final_model", "checkpoints",
    "rollouts", "previous", ".run.lock",
)  # fmt: skip
_REPLAY_CACHE_FILE = "replay-cache.jsonl"


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


def _is_run_dir(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (
        (folder / "metrics.jsonl").is_file() or (folder / ".run.lock").is_file()
    )


def owner_of(path: str | os.PathLike[str]) -> tuple[str, str] | None:
    """``(kind, what)`` when ``path`` is a file some command keeps (``kind`` one of
    :data:`OWNED_KINDS`, ``what`` a phrase naming it), else None."""
    target = Path(path).expanduser().absolute()
    if target.name == _REPLAY_CACHE_FILE:
        return "replay_cache", "the teacher-replay cache (a rerun would pay for every call again)"
    from composer_replication.common.project_cache import cache_dir

    if _inside(target, cache_dir()):
        return "project_cache", f"in the project's cache {str(cache_dir())!r}"
    for folder in target.parents:
        if _is_run_dir(folder):
            rel = target.relative_to(folder)
            if rel.parts and rel.parts[0] in _RUN_ENTRIES:
                return "run_record", f"part of the record of the run in {str(folder)!r}"
            break
    package = Path(__file__).resolve().parents[1]  # common/ -> the package
    checkout = package.parent.parent  # src/composer_replication -> the repository
    sources = [package]
    if (checkout / "pyproject.toml").is_file() and (checkout / "benchmarks").is_dir():
        sources += [checkout / "benchmarks", checkout / "tests", checkout / "configs"]
    if any(_inside(target, folder) for folder in sources) and target.exists():
        return "source", "one of the project's own files"
    if target.exists() and is_generation_output(target):
        return "task_generation", "a task generation's output (tasks, references, candidates)"
    return None


def _check_length(target: Path, shown: str) -> None:
    """A path the system cannot hold (a name or the whole path past its limits) is refused
    by its length, before any call on it fails with ENAMETOOLONG."""
    absolute = str(target.absolute())
    name_max = os.pathconf("/", "PC_NAME_MAX")
    path_max = os.pathconf("/", "PC_PATH_MAX")
    longest = max((len(part.encode()) for part in absolute.split("/")), default=0)
    if longest > name_max or len(absolute.encode()) >= path_max:
        raise OutputError(
            f"cannot write {shortened(shown)}: path too long ({len(absolute.encode())} bytes, a name of "
            f"{longest}; this system allows {path_max} bytes and names of {name_max}); pass a "
            "shorter path"
        )


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
    owns: Iterable[str] = (),
) -> Path:
    """The file to write for the output ``path``, or :class:`OutputError` (see the module).

    ``inputs`` are files the command reads, ``input_dirs`` folders it reads every file
    of; ``option`` names the flag in messages; ``owns``: kinds of :func:`owner_of` the
    command keeps itself (it may overwrite those). Returns the path to write: ``path``
    itself, or a followed link's target.
    """
    given = Path(path).expanduser()
    shown = repr(str(path))
    _check_length(given, shown)
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
    owner = owner_of(target)
    if owner is not None and owner[0] not in set(owns):
        raise OutputError(
            f"output {shown} is {owner[1]}, not this command's to write: pass another {option}"
        )
    _check_folder(target, shown)
    return target


def check_output_dir(
    path: str | os.PathLike[str], *, option: str = "--output-dir", follow_symlinks: bool = False
) -> Path:
    """An output directory: absent (then its folder must be writable) or a writable
    directory; a file, a device, an unwritable directory or (unless ``follow_symlinks``) a
    symbolic link, whose writes would land elsewhere, is an :class:`OutputError`."""
    target = Path(path).expanduser()
    shown = repr(str(path))
    _check_length(target, f"{option} {shown}")
    if target.is_symlink() and not follow_symlinks:
        raise OutputError(
            f"{option} {shown} is a symbolic link; pass the folder it points to "
            f"({str(target.resolve())!r}) if that is where the files should go"
        )
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


#: the file a task generation puts in every folder it makes
OUTPUT_MARKER = ".composer-replication-output"
# hidden answers of any earlier generation (ours or another's), and split records
_BY_NAME = re.compile(r".*\.reference\..*|.*\.split\.json")
# the task ids a generation writes: datagen's (fd:) and import-tasks' (swe:)
_TASK_ID = re.compile(r'"task_id"\s*:\s*"(fd|swe):')
_OUTPUT_SUFFIXES = (".workdirs", ".envs")


def _is_task_record_file(path: Path) -> bool:
    if path.suffix not in (".jsonl", ".json") or not path.is_file() or path.is_symlink():
        return False
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            first = fh.readline(1 << 16)
    except OSError:
        return False
    return bool(_TASK_ID.search(first))


def is_generation_output(path: Path) -> bool:
    """Whether ``path`` is something a task generation wrote: a folder marked with
    :data:`OUTPUT_MARKER` (or an older one beside its task file), a virtualenv, a task,
    held-out, reference, split or candidate file (by name or first record)."""
    if _BY_NAME.fullmatch(path.name):
        return True
    if path.is_dir() and not path.is_symlink():
        if (path / OUTPUT_MARKER).exists() or (path / "pyvenv.cfg").exists():
            return True
        for suffix in _OUTPUT_SUFFIXES:  # an older generation's: its task file is beside it
            if path.name.endswith(suffix):
                stem = path.name[: -len(suffix)]
                if _is_task_record_file(path.with_name(f"{stem}.jsonl")):
                    return True
        return False
    if _is_task_record_file(path):
        return True
    # a task file with no record (all of a generation's tasks held out) is known by the
    # outputs written beside it
    stem = path.name[: -len(".jsonl")] if path.name.endswith(".jsonl") else None
    return stem is not None and (
        path.with_name(f"{stem}.split.json").is_file()
        or (path.with_name(f"{stem}.workdirs") / OUTPUT_MARKER).is_file()
    )
