"""A distinct unprivileged uid for every concurrent sandbox run.

RLIMIT_NPROC counts the processes of a uid across the whole host: sandboxes that share one
uid share one process budget, so a fork bomb in one rollout starves the others (``bwrap:
Can't fork``) and their honest answers score 0. :func:`lease_uid` hands each run its own uid
from a range no account uses, held by an ``flock`` on a per-uid lock file for as long as the
run lasts, so concurrent runs in this process and in other processes never share one. A
uid needs no account: it owns the run's workdir and nothing else.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["FIRST_UID", "NOBODY_UID", "POOL_SIZE", "lease_uid", "resolve_identity"]

NOBODY_UID = 65534
FIRST_UID = 612_000
POOL_SIZE = 256
LOCK_DIR = Path("/dev/shm/composer-replication-uids")


@contextlib.contextmanager
def lease_uid(lock_dir: Path = LOCK_DIR) -> Iterator[int]:
    """A uid no other live run holds, for the duration of the ``with`` block.

    Raises ``RuntimeError`` when all ``POOL_SIZE`` uids are taken.
    """
    lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    start = os.getpid() % POOL_SIZE  # spread processes over the pool
    for k in range(POOL_SIZE):
        uid = FIRST_UID + (start + k) % POOL_SIZE
        fd = os.open(lock_dir / str(uid), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield uid
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        return
    raise RuntimeError(f"all {POOL_SIZE} sandbox uids are in use; lower the number of workers")


def resolve_identity(uid: int | None, gid: int | None) -> tuple[int | None, int | None]:
    """The (uid, gid) a sandbox switches to, or (None, None) for "stay who we are".

    As root the default is nobody (so RLIMIT_NPROC is enforced); a non-root process cannot
    switch, so asking it to is a ``ValueError``.
    """
    euid = os.geteuid()
    if uid is None:
        uid = NOBODY_UID if euid == 0 else None
    if uid is not None and euid != 0 and uid != euid:
        raise ValueError(
            f"run_as_uid={uid} needs root to switch user (we run as uid {euid}); "
            "leave run_as_uid unset to run as the current user"
        )
    if uid is None or uid == euid:
        return None, None
    return uid, gid if gid is not None else uid
