"""Make a host directory usable as a sandbox workdir for an unprivileged uid.

The sandbox drops root to an unprivileged uid, so that uid must be able to reach the workdir
(every ancestor traversable) and write inside it (we hand the tree over with `lchown`, never
following symlinks).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = [
    "SHARED_CACHE_ENV",
    "check_reachable",
    "disk_usage",
    "filesystem_block",
    "hand_over",
    "make_shared_tempdir",
    "over_quota",
    "quota_fitting",
    "quota_reached",
    "quota_room",
    "reachable_by_sandbox",
    "shared_cache_dir",
]

#: Overrides where :func:`shared_cache_dir` keeps what sandboxes must reach across runs.
SHARED_CACHE_ENV = "COMPOSER_REPLICATION_SHARED_CACHE"


def _can_traverse(st: os.stat_result, uid: int, gid: int) -> bool:
    if uid == 0:
        return True
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == gid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def check_reachable(path: Path, uid: int, gid: int) -> None:
    """Raise `ValueError` naming the first ancestor of `path` that `uid` cannot traverse."""
    for ancestor in reversed(path.parents):
        st = os.stat(ancestor)
        if not _can_traverse(st, uid, gid):
            raise ValueError(
                f"sandbox workdir {str(path)!r} is not reachable by uid {uid}: "
                f"{str(ancestor)!r} has mode {stat.filemode(st.st_mode)} and owner uid "
                f"{st.st_uid}. Put sandbox workdirs under a directory every user can "
                "traverse, e.g. datagen.workdir.make_shared_tempdir()"
            )


def reachable_by_sandbox(path: Path) -> bool:
    """Whether the sandbox's unprivileged uid (nobody, where we are root) can traverse every
    existing ancestor of ``path`` (and ``path`` itself when it exists); always True for an
    unprivileged user, whose sandbox runs as that user."""
    if os.geteuid() != 0:
        return True
    for ancestor in [*reversed(path.parents), path]:
        try:
            st = os.stat(ancestor)
        except FileNotFoundError:
            return True  # made below it with a traversable mode
        if not _can_traverse(st, 65534, 65534):
            return False
    return True


def shared_cache_dir(name: str) -> Path:
    """``<root>/<name>``: a persistent folder of ours that the sandbox uid can traverse, for
    what sandboxes must reach when the user's own folders are private (a home directory of
    mode 0700). ``<root>`` is ``$COMPOSER_REPLICATION_SHARED_CACHE``, else
    ``/var/tmp/composer-replication-<uid>``; it is made with mode 0755 and must be a folder
    we own that nobody else can write to (a link or another user's folder is refused).

    Raises:
        ValueError: the root is unusable (one line naming it and the fix).
    """
    given = os.environ.get(SHARED_CACHE_ENV, "").strip()
    root = Path(given) if given else Path("/var/tmp") / f"composer-replication-{os.geteuid()}"
    try:
        root.mkdir(mode=0o755, parents=True, exist_ok=True)
        st = os.lstat(root)
    except OSError as exc:
        raise ValueError(
            f"cannot make the shared cache {str(root)!r} ({exc.strerror}); set "
            f"{SHARED_CACHE_ENV} to a folder every user can traverse"
        ) from None
    if (
        not stat.S_ISDIR(st.st_mode)
        or st.st_uid != os.geteuid()
        or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    ):
        raise ValueError(
            f"the shared cache {str(root)!r} is not a folder of ours that only we can write "
            f"(mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid}); remove it or set "
            f"{SHARED_CACHE_ENV} to another folder"
        )
    if not reachable_by_sandbox(root):
        raise ValueError(
            f"the shared cache {str(root)!r} is not reachable by the sandbox uid; set "
            f"{SHARED_CACHE_ENV} to a folder every user can traverse, e.g. under /var/tmp"
        )
    path = root / name
    path.mkdir(mode=0o755, exist_ok=True)
    return path


def hand_over(path: Path, uid: int | None, gid: int | None) -> None:
    """`lchown` the tree under `path` to `uid:gid` (no-op when `uid` is None)."""
    if uid is None:
        return
    gid = uid if gid is None else gid
    root_st = os.lstat(path)
    if root_st.st_uid != uid or root_st.st_gid != gid:
        os.lchown(path, uid, gid)
    os.chmod(path, stat.S_IMODE(root_st.st_mode) | stat.S_IRWXU)
    for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
        for name in (*dirnames, *filenames):
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            if st.st_uid != uid or st.st_gid != gid:
                os.lchown(full, uid, gid)


def make_shared_tempdir(prefix: str = "composer-replication-") -> Path:
    """A fresh temp directory (mode 0755) that an unprivileged sandbox uid can reach.

    `tempfile.mkdtemp` makes 0700 directories, and pytest's `tmp_path` sits under a 0700
    per-user root, so neither can hold a workdir for a sandbox that runs as nobody. Tries the
    default temp dir, then /tmp and /var/tmp.
    """
    import shutil
    import tempfile

    for base in (None, "/tmp", "/var/tmp"):
        if base is not None and not os.path.isdir(base):
            continue
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
        os.chmod(path, 0o755)
        try:
            check_reachable(path / "x", 65534, 65534)
        except ValueError:
            shutil.rmtree(path, ignore_errors=True)
            continue
        return path
    raise RuntimeError(
        "no temp directory traversable by every user (tried $TMPDIR, /tmp, /var/tmp)"
    )


def disk_usage(root: str | os.PathLike[str], stop_above: int | None = None) -> int:
    """Bytes of disk the tree under ``root`` occupies (allocated blocks, by ``lstat``, links
    not followed, a file with several hard links once). Stops counting once past
    ``stop_above`` (the answer is then a lower bound above it): a quota check needs no more."""
    total = 0
    linked: set[tuple[int, int]] = set()
    pending = [os.fspath(root)]
    while pending:
        try:
            entries = os.scandir(pending.pop())
        except OSError:  # vanished or unreadable meanwhile: nothing to count there
            continue
        with entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                    if (st.st_dev, st.st_ino) in linked:
                        continue
                    linked.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
                if stat.S_ISDIR(st.st_mode):
                    pending.append(entry.path)
                if stop_above is not None and total > stop_above:
                    return total
    return total


def filesystem_block(root: str | os.PathLike[str]) -> int:
    """The allocation unit of the filesystem holding ``root`` (what ``st_blocks`` grows by)."""
    try:
        return os.statvfs(root).f_frsize or 4096
    except OSError:
        return 4096


def quota_room(root: str | os.PathLike[str], quota_bytes: int) -> int:
    """How large one file may grow before the tree under ``root`` passes ``quota_bytes``:
    the room left, rounded down to whole filesystem blocks (a file of that size occupies at
    most that much); 0 when not one block is left."""
    block = filesystem_block(root)
    room = quota_bytes - disk_usage(root, quota_bytes)
    return max(0, room) // block * block


def quota_fitting(root: str | os.PathLike[str], headroom_mb: int = 512) -> int:
    """A workdir quota in MB that fits the tree under ``root`` as it is (its size rounded
    up to whole MiB) plus ``headroom_mb`` for what commands write."""
    return -(-disk_usage(root) // (1024 * 1024)) + headroom_mb


def quota_reached(quota_bytes: int) -> str:
    """The reason a command is stopped or refused at the quota (the text it shows)."""
    return f"the workdir reached its disk quota of {quota_bytes // (1024 * 1024)} MB"


def over_quota(root: str | os.PathLike[str], quota_bytes: int | None) -> str | None:
    """Why the tree under ``root`` has reached ``quota_bytes`` (not one filesystem block
    left under it), or None when it has not (or there is no quota)."""
    if quota_bytes is None or quota_room(root, quota_bytes) > 0:
        return None
    return quota_reached(quota_bytes)
