"""One run per output directory at a time.

Two runs writing one directory would interleave their metrics rows, overwrite each other's
config.json and final model, and one would move the other's record aside. A run therefore
holds an exclusive lock on ``<run_dir>/.run.lock`` from before it reads or moves anything
there (a resume's checkpoint, a previous run's record) until its last file is written. The
lock is the kernel's (``flock``): it goes with its process, however that process ends
(SIGKILL included), so a lock file left behind never blocks anyone. The file names its
holder (pid, start time, host, command) for the refusal message, and is removed on release.
Where the filesystem has no ``flock`` (some network filesystems), the holder named in the
file is checked instead: a live process with the recorded pid AND start time holds it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from composer_replication.common.errors import UsageError
from composer_replication.common.pids import same_process, start_ticks

__all__ = ["LOCK_NAME", "RunDirectoryBusy", "RunDirectoryLock", "check_run_directory_free"]

LOCK_NAME = ".run.lock"


class RunDirectoryBusy(UsageError):
    """Another run holds the output directory (a usage error: one line, exit code 2)."""


def _holder_line(text: str) -> str:
    try:
        holder = json.loads(text)
        return (
            f"pid {holder['pid']} on {holder['host']}, started {holder['started']}: "
            f"{holder['command']}"
        )
    except (ValueError, KeyError, TypeError):
        return "a process that left no record"


class RunDirectoryLock:
    """The exclusive lock of one run directory; a context manager.

    Raises:
        RunDirectoryBusy: (on entering) another live run holds the directory; the message
            names the directory, the holder and the fix.
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _refuse(self, holder: str) -> RunDirectoryBusy:
        return RunDirectoryBusy(
            f"{self.run_dir} is in use by another run ({_holder_line(holder)}); wait for it "
            "to end, or give this run another output directory (--output-dir)"
        )

    def _record(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "start_ticks": start_ticks(os.getpid()),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300],
        }

    def acquire(self) -> None:
        if self._fd is not None:
            raise RuntimeError(f"the lock of {self.run_dir} is already held by this object")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        while True:
            _check_lock_file(self.path)
            try:  # never through a link: the file it names would be overwritten
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError as err:
                raise _unusable(self.path, err) from None
            try:
                self._lock(fd)
                # the holder before us may have removed the file between our open and our
                # lock: then we hold a lock nobody else can see; start again
                if os.fstat(fd).st_ino != os.stat(self.path).st_ino:
                    os.close(fd)
                    continue
            except FileNotFoundError:
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                raise
            break
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(self._record()).encode("utf-8"))
        self._fd = fd

    def _lock(self, fd: int) -> None:
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._refuse(_read(fd)) from None
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            # no flock here: the recorded holder decides
            holder = _read(fd)
            try:
                record = json.loads(holder)
                alive = record["pid"] != os.getpid() and same_process(
                    int(record["pid"]), ticks=record.get("start_ticks")
                )
            except (ValueError, KeyError, TypeError):
                alive = False
            if alive:
                raise self._refuse(holder) from None

    def release(self) -> None:
        """Remove the lock file, then let the lock go (in that order: a run waiting on the
        old file notices it is gone and takes a new one)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunDirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _unusable(path: Path, err: OSError) -> RunDirectoryBusy:
    return RunDirectoryBusy(
        f"the run's lock file {str(path)!r} cannot be opened ({err.strerror}); remove it, or "
        "give this run another output directory (--output-dir)"
    )


def _check_lock_file(path: Path) -> None:
    """Refuse a lock path that is not a regular file (a link, a folder, a FIFO): the run
    only ever writes its own plain file there."""
    import stat

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        from composer_replication.common.outputs import file_kind

        raise RunDirectoryBusy(
            f"the run's lock file {str(path)!r} is {file_kind(st.st_mode)}, not a file this "
            "command made; remove it, or give this run another output directory (--output-dir)"
        )


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode("utf-8", errors="replace")
    except OSError:
        return ""


def check_run_directory_free(run_dir: str | os.PathLike[str]) -> None:
    """Refuse, before anything loads, a run directory another run holds now (the run takes
    the lock itself when it starts; this only fails early). Creates nothing.

    Raises:
        RunDirectoryBusy: the directory, the holder, the fix.
    """
    path = Path(run_dir) / LOCK_NAME
    _check_lock_file(path)
    if not path.is_file():
        return
    lock = RunDirectoryLock(run_dir)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return  # gone meanwhile, or unreadable: the run's own lock decides
    try:
        lock._lock(fd)  # refuses while held
    finally:
        os.close(fd)  # our probe's lock (if taken) goes with the descriptor
