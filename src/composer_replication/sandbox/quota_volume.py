"""A workdir quota the kernel enforces: a size-limited tmpfs standing in for the workdir.

A holder process (``unshare --mount``) mounts a tmpfs of exactly the quota over the
workdir's path in a mount namespace of its own and then waits on a pipe from us; a command
joins that namespace (``setns`` in the child, before it drops root and before bubblewrap
binds the workdir), so every byte it writes lands on the tmpfs and a write past the quota
fails with ENOSPC, whatever the number of files or processes writing at once. The host
reaches the volume through ``/proc/<holder>/root<workdir>``.

The host directory stays the one record. Before each command the volume is made a copy of
it (``load``), after the command the host directory is made a copy of the volume
(``store``). Both copies only move what changed since the last one, judged by inode and
change time, which code in the sandbox cannot set back. Change times come from a coarse
clock, so a copy returns only once that clock has ticked past its last write: a later
change always moves a change time. They never follow a symbolic link,
keep hard links as links and holes as holes (so the host never gets more bytes than the
volume held), drop set-uid/set-gid bits and skip sockets and device nodes.

Needs root (CAP_SYS_ADMIN, to make the namespace) and util-linux's ``unshare``;
``volume_support()`` says why not otherwise, and the sandbox then measures the tree instead.
The holder ends when we close the pipe, are garbage-collected or die (EOF on its stdin), and
the tmpfs with it. Its pages are memory: a full volume holds ``quota`` bytes of RAM, charged
to the run's control group that wrote them.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
import subprocess
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from composer_replication.sandbox.files import mode_kind
from composer_replication.sandbox.process import MountNamespace

__all__ = [
    "QuotaVolume",
    "VolumeError",
    "VolumeFull",
    "mirror_tree",
    "volume_inodes",
    "volume_support",
]

_COPY_CHUNK = 1 << 20
_SETID = stat.S_ISUID | stat.S_ISGID
_READY = b"ready\n"
# Change times come from a coarse clock: one tick is 1-10 ms (HZ 1000 down to 100).
_CLOCK_TICK_NS = 20_000_000
# None: not probed yet; "": usable; else why not.
_SUPPORT: list[str | None] = [None]


class VolumeError(OSError):
    """The volume could not be made, filled from or copied back to the host."""


class VolumeFull(VolumeError):
    """The host directory no longer fits the volume (more than the quota, or inodes)."""


def volume_inodes(quota_bytes: int) -> int:
    """How many files and directories a volume of ``quota_bytes`` may hold: one per 4 KiB
    of quota, at least 4096 (each costs kernel memory that the size limit does not count)."""
    return max(4096, quota_bytes // 4096)


def volume_support() -> str:
    """ "" when a quota volume can be made here, else why not (probed once per process)."""
    if _SUPPORT[0] is None:
        _SUPPORT[0] = _probe()
    return _SUPPORT[0]


def _probe() -> str:
    if os.geteuid() != 0:
        return "a mount namespace needs root"
    if shutil.which("unshare") is None:
        return "util-linux's unshare is not installed"
    if not hasattr(ctypes.CDLL(None), "setns"):
        return "the C library has no setns"
    probe_dir = Path("/")
    try:
        holder = _start_holder(probe_dir, 4096 * 16, 64)
    except VolumeError as exc:
        return str(exc)
    _stop_holder(holder)
    return ""


def _start_holder(workdir: Path, quota_bytes: int, inodes: int) -> subprocess.Popen[bytes]:
    options = f"size={quota_bytes},nr_inodes={inodes},mode=0700"
    script = 'mount -t tmpfs -o "$1" composer-quota "$2" && echo ready && exec cat >/dev/null'
    argv = ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script]
    try:
        holder = subprocess.Popen(
            [*argv, "holder", options, str(workdir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            close_fds=True,
        )
    except OSError as exc:
        raise VolumeError(f"could not start unshare: {exc}") from exc
    assert holder.stdout is not None and holder.stderr is not None
    if holder.stdout.readline() != _READY:
        holder.kill()
        _, err = holder.communicate()
        text = err.decode(errors="replace").strip()[-300:]
        raise VolumeError(f"could not mount a tmpfs in a mount namespace: {text!r}")
    holder.stdout.close()
    holder.stderr.close()
    return holder


def _stop_holder(holder: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError, ValueError):
        if holder.stdin is not None:
            holder.stdin.close()  # EOF: the holder's cat ends, and the namespace with it
    try:
        holder.wait(timeout=5)
    except subprocess.TimeoutExpired:
        holder.kill()
        holder.wait()


class QuotaVolume:
    """A tmpfs of ``quota_bytes`` over ``workdir``'s path, in a mount namespace of its own.

    ``namespace_fd`` is what a command's child joins (``mount_namespace()``); ``path`` is the
    volume as the host sees it. ``load``/``store`` copy between it and the host directory.
    """

    def __init__(self, workdir: Path, quota_bytes: int) -> None:
        self.workdir = Path(workdir)
        self.quota_bytes = quota_bytes
        self._holder = _start_holder(self.workdir, quota_bytes, volume_inodes(quota_bytes))
        try:
            self.namespace_fd = os.open(f"/proc/{self._holder.pid}/ns/mnt", os.O_RDONLY)
        except OSError as exc:
            _stop_holder(self._holder)
            raise VolumeError(f"could not open the volume's mount namespace: {exc}") from exc
        self.path = Path(f"/proc/{self._holder.pid}/root{self.workdir}")
        # relative path -> (host signature, volume signature) when they were last equal
        self._synced: dict[str, tuple[_Sig, _Sig]] = {}
        self._finalizer = weakref.finalize(self, _close, self._holder, self.namespace_fd)

    def load(self, owner: tuple[int, int]) -> None:
        """Make the volume a copy of the host directory, every entry owned by ``owner``
        (uid, gid): the identity the next command runs as.

        Raises VolumeFull when the host directory does not fit, VolumeError otherwise."""
        try:
            self._synced = mirror_tree(self.workdir, self.path, self._synced, owner=owner)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise VolumeFull(f"the workdir does not fit its quota volume: {exc}") from exc
            raise VolumeError(f"could not copy the workdir into its quota volume: {exc}") from exc

    def store(self) -> None:
        """Make the host directory a copy of the volume (what the command left there)."""
        flipped = {rel: (vol, host) for rel, (host, vol) in self._synced.items()}
        try:
            stored = mirror_tree(self.path, self.workdir, flipped, owner=None)
        except OSError as exc:
            self._synced = {}  # unknown state: the next load copies everything
            raise VolumeError(
                f"could not copy the quota volume back to the workdir: {exc}"
            ) from exc
        self._synced = {rel: (host, vol) for rel, (vol, host) in stored.items()}

    def mount_namespace(self) -> MountNamespace:
        """The volume's mount namespace and workdir, for a command's child to join
        (``run_bounded(namespace=...)``)."""
        return MountNamespace(self.namespace_fd, str(self.workdir))

    @property
    def alive(self) -> bool:
        return self._finalizer.alive and self._holder.poll() is None

    def close(self) -> None:
        """End the holder (the tmpfs and whatever was left on it go with it)."""
        self._finalizer()


def _close(holder: subprocess.Popen[bytes], namespace_fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(namespace_fd)
    _stop_holder(holder)


# --- copying one tree onto another ------------------------------------------------------


@dataclass(frozen=True)
class _Sig:
    """What changes whenever an entry's content or metadata does: a new inode, or a new
    change time (set by the kernel on every write, chmod, chown or rename; not settable)."""

    ino: int
    ctime_ns: int
    mode: int

    @classmethod
    def of(cls, st: os.stat_result) -> _Sig:
        return cls(st.st_ino, st.st_ctime_ns, st.st_mode)


def mirror_tree(
    src: Path,
    dst: Path,
    synced: dict[str, tuple[_Sig, _Sig]],
    *,
    owner: tuple[int, int] | None,
) -> dict[str, tuple[_Sig, _Sig]]:
    """Make the tree under ``dst`` a copy of the tree under ``src``; return the new record.

    ``synced`` maps relative paths to the (src, dst) signatures they had when last equal:
    an entry whose signatures both still match is not copied again. Having written
    anything, it returns only once the clock is a tick past that write, so a change made
    after it returns cannot keep the change time the record holds. Symbolic links are
    copied as links and never followed; hard links stay links; holes stay holes; regular
    files lose set-uid/set-gid bits; sockets and device nodes are left out (and removed
    from ``dst``). ``owner`` (uid, gid) owns every ``dst`` entry; None gives each the owner
    of its source (as root; otherwise they stay ours).
    """
    record: dict[str, tuple[_Sig, _Sig]] = {}
    links: dict[tuple[int, int], str] = {}  # (dev, ino) of a src file -> its first dst path
    copy_owner = owner is None and os.geteuid() == 0
    last_write_ns = 0
    root_st = os.lstat(src)
    _match_dir(root_st, str(dst), _owner_of(root_st) if copy_owner else owner, root=True)
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        src_dir = os.path.join(src, rel_dir)
        dst_dir = os.path.join(dst, rel_dir)
        wanted = {e.name: e.stat(follow_symlinks=False) for e in os.scandir(src_dir)}
        present = {e.name: e.stat(follow_symlinks=False) for e in os.scandir(dst_dir)}
        for name, there in list(present.items()):
            st = wanted.get(name)
            if st is None or _kind(st) != _kind(there):
                _remove(os.path.join(dst_dir, name))
                del present[name]
        for name, st in sorted(wanted.items()):
            rel = os.path.join(rel_dir, name)
            target = os.path.join(dst_dir, name)
            kind = _kind(st)
            there = present.get(name)
            if kind == "dir":
                if there is None:
                    os.mkdir(target, 0o700)
                _match_dir(st, target, _owner_of(st) if copy_owner else owner)
                pending.append(rel)
                continue
            if kind is None:  # sockets, devices: nothing a workdir needs
                continue
            first = links.get((st.st_dev, st.st_ino)) if st.st_nlink > 1 else None
            changed = False
            if first is not None:
                changed = _link(first, target, there)
            else:
                if st.st_nlink > 1:
                    links[(st.st_dev, st.st_ino)] = target
                fresh = (
                    there is not None
                    and synced.get(rel) == (_Sig.of(st), _Sig.of(there))
                    and there.st_nlink == st.st_nlink
                )
                if not fresh:
                    _copy_entry(os.path.join(src, rel), target, st, kind)
                    changed = True
                want = owner or (_owner_of(st) if copy_owner else None)
                if want is not None and (changed or _owner_of(there) != want):
                    os.lchown(target, *want)
                    changed = True
            if changed:
                there = os.lstat(target)
                last_write_ns = max(last_write_ns, there.st_ctime_ns)
            record[rel] = (_Sig.of(st), _Sig.of(there))
    _wait_past(last_write_ns)
    return record


def _wait_past(change_ns: int) -> None:
    """Sleep until the coarse clock of change times has surely moved past ``change_ns``."""
    if change_ns:
        time.sleep(max(0.0, (change_ns + _CLOCK_TICK_NS - time.time_ns()) / 1e9))


def _kind(st: os.stat_result) -> str | None:
    kind = mode_kind(st.st_mode)
    return None if kind in ("socket", "device") else kind


def _remove(path: str) -> None:
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _match_dir(st: os.stat_result, target: str, owner: tuple[int, int] | None, root=False) -> None:
    mode = stat.S_IMODE(st.st_mode) | (stat.S_IRWXU if root else 0)
    present = os.lstat(target)
    if owner is not None and (present.st_uid, present.st_gid) != owner:
        os.lchown(target, *owner)
    if stat.S_IMODE(present.st_mode) != mode:
        os.chmod(target, mode)


def _owner_of(st: os.stat_result) -> tuple[int, int]:
    return st.st_uid, st.st_gid


def _link(first: str, target: str, there: os.stat_result | None) -> bool:
    """Make ``target`` a hard link of ``first``; False when it already was one."""
    if there is not None and there.st_ino == os.lstat(first).st_ino:
        return False
    if there is not None:
        _remove(target)
    os.link(first, target, follow_symlinks=False)
    return True


def _copy_entry(source: str, target: str, st: os.stat_result, kind: str) -> None:
    if os.path.lexists(target):
        _remove(target)
    if kind == "link":
        os.symlink(os.readlink(source), target)
        return
    if kind == "fifo":
        os.mkfifo(target, stat.S_IMODE(st.st_mode))
        return
    mode = stat.S_IMODE(st.st_mode) & ~_SETID
    src_fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        dst_fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            _copy_data(src_fd, dst_fd, st.st_size)
            os.fchmod(dst_fd, mode)
            os.utime(dst_fd, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)


def _copy_data(src_fd: int, dst_fd: int, size: int) -> None:
    """Copy the data regions of ``src_fd`` (holes are skipped, so they stay holes)."""
    position = 0
    while position < size:
        try:
            start = os.lseek(src_fd, position, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole is left
                break
            raise
        end = os.lseek(src_fd, start, os.SEEK_HOLE)
        os.lseek(src_fd, start, os.SEEK_SET)
        os.lseek(dst_fd, start, os.SEEK_SET)
        remaining = end - start
        while remaining > 0:
            chunk = os.read(src_fd, min(_COPY_CHUNK, remaining))
            if not chunk:
                break
            view = memoryview(chunk)
            while view:
                view = view[os.write(dst_fd, view) :]
            remaining -= len(chunk)
        position = end
    os.ftruncate(dst_fd, size)
