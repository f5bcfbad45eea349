"""The bubblewrap command line of `LocalSubprocessSandbox`, and a cached "does it work" probe.

Mount order matters: read-only root, fresh /proc and /dev, a private size-limited /tmp and
/dev/shm, empty tmpfs over the hidden directories, read-only binds of what must stay visible (the pytest
bundle, an interpreter living under a hidden directory), the writable workdir, and only then
the hidden tmpfs are remounted read-only (their mount points had to be created first).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

from composer_replication.sandbox.process import run_bounded

__all__ = ["BASE_PATH", "DEFAULT_HIDE_PATHS", "bwrap_argv", "find_bwrap", "probe_bwrap"]

BASE_PATH = "/usr/local/bin:/usr/bin:/bin"
DEFAULT_HIDE_PATHS: tuple[str, ...] = (
    "/root",
    "/home",
    "/var/tmp",
    "/run",
    "/var/run",
    "/mnt",
    "/media",
    "/srv",
)
# (bwrap path, uid) -> None when usable, else the reason it is not.
_PROBES: dict[tuple[str, int | None], str | None] = {}


def _namespace_args(bwrap: str) -> list[str]:
    return [
        bwrap,
        "--unshare-all",  # user, ipc, pid, net, uts, cgroup
        "--unshare-user",
        "--disable-userns",  # no nested user namespaces (a common escalation path)
        "--die-with-parent",
        "--new-session",  # no TIOCSTI injection into our terminal
        "--ro-bind", "/", "/",
        "--proc", "/proc",
        "--dev", "/dev",
    ]  # fmt: skip


def probe_bwrap(bwrap: str, uid: int | None, gid: int | None) -> str | None:
    """None when `bwrap` can build a sandbox as `uid`, else why not (cached per process)."""
    key = (bwrap, uid)
    if key not in _PROBES:
        outcome = run_bounded(
            [*_namespace_args(bwrap), "--", "/bin/sh", "-c", "exit 0"],
            cwd="/",
            env={"PATH": BASE_PATH},
            timeout_s=10,
            max_output_bytes=4096,
            uid=uid,
            gid=gid,
        )
        ok = outcome.exit_code == 0
        _PROBES[key] = None if ok else f"bwrap failed: {outcome.text().strip()!r}"
    return _PROBES[key]


def find_bwrap(
    bwrap_path: str | os.PathLike[str] | None, uid: int | None, gid: int | None
) -> tuple[str | None, str]:
    """(the usable ``bwrap`` executable, "") or (None, why not) for ``bwrap_path``: "auto"
    looks it up on PATH, None means "do not use bubblewrap"."""
    if bwrap_path is None:
        return None, "bwrap_path=None"
    found = shutil.which("bwrap") if bwrap_path == "auto" else os.fspath(bwrap_path)
    if not found or not os.access(found, os.X_OK):
        return None, f"bubblewrap not found ({bwrap_path!r})"
    reason = probe_bwrap(found, uid, gid)
    if reason is not None:
        return None, reason
    return found, ""


def _is_under(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
    except ValueError:
        return False
    return True


#: Directories the sandbox gets as its own empty tmpfs.
PRIVATE_DIRS = (Path("/tmp"), Path("/dev/shm"))


def _is_private(path: Path) -> bool:
    return any(_is_under(path, root) for root in PRIVATE_DIRS)


def bwrap_argv(
    bwrap: str,
    inner: Sequence[str],
    *,
    workdir: Path,
    env: Mapping[str, str],
    tmp_size_mb: int,
    hide_paths: Sequence[str],
    ro_binds: Sequence[str],
    python: str,
    shm_size_mb: int = 64,
    workdir_writable: bool = True,
) -> list[str]:
    """The full bubblewrap argv that runs `inner` in `workdir` with exactly `env`.

    /tmp and /dev/shm are private tmpfs of bounded size (bubblewrap's /dev would otherwise
    hold an unbounded /dev/shm in host memory); the workdir is bound read-only when
    ``workdir_writable`` is False.
    """
    args = _namespace_args(bwrap)
    args += ["--size", str(tmp_size_mb * 1024 * 1024), "--tmpfs", "/tmp"]
    args += ["--size", str(shm_size_mb * 1024 * 1024), "--tmpfs", "/dev/shm"]
    # Nothing of the host's /tmp or /dev/shm is in the sandbox's fresh ones: a hidden path
    # there needs no cover, and a mount point for one would show its name.
    hidden_paths = [h for h in hide_paths if not _is_private(Path(h))]
    for hidden in hidden_paths:
        args += ["--tmpfs", hidden]
    binds = list(ro_binds)
    for prefix in (Path(python).parent.parent, Path(python).resolve().parent.parent):
        if _is_private(prefix) or any(_is_under(prefix, Path(h)) for h in hide_paths):
            binds.append(str(prefix))  # the interpreter must stay visible
    for path in dict.fromkeys(binds):
        args += ["--ro-bind", path, path]
    bind = "--bind" if workdir_writable else "--ro-bind"
    args += [bind, str(workdir), str(workdir), "--chdir", str(workdir)]
    for hidden in hidden_paths:
        args += ["--remount-ro", hidden]
    args.append("--clearenv")
    for key, value in env.items():
        args += ["--setenv", key, value]
    return [*args, "--", *inner]
