"""Whole-sandbox memory and process limits with Linux control groups, where they are usable.

RLIMIT_AS and RLIMIT_NPROC bound each process (and each uid), not a sandbox: four processes
of 800 MB pass a 1 GB RLIMIT_AS. A control group bounds the whole process tree of one run:
``memory.limit_in_bytes`` (v1) / ``memory.max`` (v2) for its memory and ``pids.max`` for its
process count. :func:`cgroup_support` finds a writable hierarchy once per process (cgroup v2
with the memory and pids controllers delegated, or the v1 ``memory`` and ``pids``
hierarchies); :class:`RunCgroup` makes one group per run, the child joins it before it
drops privileges (``run_bounded(cgroup_procs=...)``), and closing it kills what is left
and removes the group.

Where no hierarchy is writable (an unprivileged user, a read-only ``/sys/fs/cgroup``) the
limits stay per process and :func:`cgroup_support` says why; the sandbox records which
limits held (``LocalSubprocessSandbox.whole_tree_limits``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CgroupSupport", "RunCgroup", "cgroup_support"]

ROOT = Path("/sys/fs/cgroup")
_GROUP = "composer_replication"


@dataclass(frozen=True)
class CgroupSupport:
    """Where run groups can be made: ``version`` 1 or 2 and the parent directories, or
    ``version`` 0 with the ``reason`` none can."""

    version: int
    memory_parent: Path | None = None
    pids_parent: Path | None = None
    reason: str = ""


_SUPPORT: CgroupSupport | None = None


def _writable_dir(path: Path) -> bool:
    try:
        path.mkdir(exist_ok=True)
    except OSError:
        return False
    probe = path / f"probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError:
        return False
    return True


def cgroup_support(root: Path = ROOT) -> CgroupSupport:
    """The usable cgroup hierarchy (detected once per process)."""
    global _SUPPORT
    if _SUPPORT is not None and root == ROOT:
        return _SUPPORT
    support = _detect(root)
    if root == ROOT:
        _SUPPORT = support
    return support


def _detect(root: Path) -> CgroupSupport:
    controllers = root / "cgroup.controllers"
    if controllers.is_file():  # cgroup v2 (unified)
        parent = root / _GROUP
        if not _writable_dir(parent):
            return CgroupSupport(0, reason=f"{root} is not writable")
        wanted = {"memory", "pids"}
        if not wanted <= set(controllers.read_text().split()):
            return CgroupSupport(0, reason="the memory/pids controllers are not available")
        try:
            (parent / "cgroup.subtree_control").write_text("+memory +pids")
        except OSError as exc:
            return CgroupSupport(0, reason=f"cannot delegate memory/pids: {exc}")
        return CgroupSupport(2, parent, parent)
    memory, pids = root / "memory" / _GROUP, root / "pids" / _GROUP
    if (root / "memory").is_dir() and (root / "pids").is_dir():
        if _writable_dir(memory) and _writable_dir(pids):
            return CgroupSupport(1, memory, pids)
        return CgroupSupport(0, reason=f"{root}/memory and {root}/pids are not writable")
    return CgroupSupport(0, reason=f"no cgroup hierarchy under {root}")


class RunCgroup:
    """One run's control group(s): memory and process-count limits for a whole tree."""

    def __init__(self, support: CgroupSupport, *, mem_mb: int, max_pids: int) -> None:
        if support.version == 0:
            raise RuntimeError(f"control groups are not usable here: {support.reason}")
        name = f"run-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.dirs: list[Path] = []
        limit = str(mem_mb * 1024 * 1024)
        if support.version == 2:
            group = support.memory_parent / name
            group.mkdir()
            self.dirs.append(group)
            (group / "memory.max").write_text(limit)
            if (group / "memory.swap.max").exists():
                (group / "memory.swap.max").write_text("0")
            (group / "pids.max").write_text(str(max_pids))
        else:
            memory = support.memory_parent / name
            memory.mkdir()
            self.dirs.append(memory)
            (memory / "memory.limit_in_bytes").write_text(limit)
            swap = memory / "memory.memsw.limit_in_bytes"
            if swap.exists():
                with contextlib.suppress(OSError):
                    swap.write_text(limit)
            pids = support.pids_parent / name
            pids.mkdir()
            self.dirs.append(pids)
            (pids / "pids.max").write_text(str(max_pids))

    @property
    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files a child writes itself into."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def close(self) -> None:
        """Kill whatever is left in the group and remove it (never raises)."""
        for d in self.dirs:
            for _ in range(50):
                try:
                    pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
                except (OSError, ValueError):
                    break
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.01)
            with contextlib.suppress(OSError):
                d.rmdir()
