"""Whether another process still runs, by its pid (for files and daemons it left behind), and
whether it is still the process a record names: a pid is reused once its process is gone, so
a record identifies its process by pid AND start time (``/proc/<pid>/stat``'s start, in clock
ticks since boot) before anyone signals it."""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["pid_alive", "same_process", "start_ticks", "started_at"]

#: a record without start ticks (written before they were kept) names a process that started
#: this close to the record's wall-clock time
START_TOLERANCE_S = 5.0


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped) counts as gone, and a
    process of another user counts as running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    fields = _stat_fields(pid)
    if fields is None:
        return True  # no procfs (macOS): trust kill(0)
    return fields[0] != "Z"


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name (field 3, the state, first), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (None: no such process, or no
    procfs)."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def started_at(pid: int) -> float | None:
    """When ``pid`` started, as a wall-clock time (None: unknown)."""
    ticks = start_ticks(pid)
    if ticks is None:
        return None
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def same_process(pid: int, *, ticks: int | None = None, started_near: float | None = None) -> bool:
    """True while ``pid`` runs and is still the process a record names: its start time is
    ``ticks`` (exact), else within ``START_TOLERANCE_S`` of the wall-clock ``started_near``.
    A record with neither, or a system without procfs, trusts the pid alone."""
    if not pid_alive(pid):
        return False
    if ticks is not None:
        now = start_ticks(pid)
        return now is None or now == int(ticks)
    if started_near is not None:
        at = started_at(pid)
        return at is None or abs(at - float(started_near)) <= START_TOLERANCE_S
    return True
