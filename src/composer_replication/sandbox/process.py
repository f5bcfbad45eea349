"""Run one child process with resource limits, a wall-clock limit and bounded output capture.

The building block under `LocalSubprocessSandbox`: the child gets its own session (so the
whole process group can be killed), per-process rlimits, an optional unprivileged uid/gid
(both applied by the child itself before it execs the command), and its combined stdout/stderr is read in chunks of which at
most `max_output_bytes` are kept (head and tail); the rest is counted and dropped, so a
command printing gigabytes never makes the host hold them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "START_MARKER",
    "MountNamespace",
    "OutputCapture",
    "ProcessOutcome",
    "ResourceLimits",
    "exec_suffix",
    "run_bounded",
    "strip_start_marker",
    "with_start_marker",
]

_READ_CHUNK = 65536
# After the main process exits, how long to keep draining output written by leftovers.
_EXIT_GRACE_S = 0.2


@dataclass(frozen=True)
class ResourceLimits:
    """Per-process rlimits applied in the child before exec.

    RLIMIT_AS bounds each process's address space (not the sum over processes), RLIMIT_NPROC
    counts every process of the child's real uid on the host and is not enforced for root.
    RLIMIT_FSIZE is ``file_mb`` MiB, or ``file_bytes`` when that is set and smaller (the
    room a workdir quota has left: the kernel stops a write at exactly that size).
    """

    mem_mb: int = 1024
    cpu_s: int = 61
    file_mb: int = 256
    open_files: int = 1024
    processes: int = 128
    file_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("mem_mb", "cpu_s", "file_mb", "open_files", "processes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ResourceLimits.{name} must be a positive int, got {value!r}")
        value = self.file_bytes
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise ValueError(
                f"ResourceLimits.file_bytes must be an int >= 0 or None, got {value!r}"
            )

    def max_file_bytes(self) -> int:
        """The RLIMIT_FSIZE value: the largest file a process may write, in bytes."""
        cap = self.file_mb * 1024 * 1024
        return cap if self.file_bytes is None else min(cap, self.file_bytes)

    def as_rlimits(self) -> list[tuple[int, int]]:
        """(resource, value) pairs, soft = hard."""
        mib = 1024 * 1024
        return [
            (resource.RLIMIT_AS, self.mem_mb * mib),
            (resource.RLIMIT_CPU, self.cpu_s),
            (resource.RLIMIT_FSIZE, self.max_file_bytes()),
            (resource.RLIMIT_NOFILE, self.open_files),
            (resource.RLIMIT_NPROC, self.processes),
            (resource.RLIMIT_CORE, 0),
        ]


@dataclass(frozen=True)
class MountNamespace:
    """A mount namespace for the child to join: an open ``/proc/<pid>/ns/mnt`` descriptor
    of this process, and the directory the child then works in."""

    fd: int
    cwd: str


def _launched(
    argv: Sequence[str],
    pairs: list[tuple[int, int]],
    cgroup_procs: Sequence[str],
    uid: int | None,
    gid: int | None,
    namespace: MountNamespace | None,
) -> list[str]:
    """``argv`` behind :mod:`~composer_replication.sandbox.exec_launcher`, which applies the
    confinement in the child itself: no Python runs between fork and exec, so the child is
    started with vfork instead of copying this (possibly very large) process."""
    from composer_replication.sandbox import exec_launcher

    spec = exec_launcher.launch_spec(
        cgroup_procs=list(cgroup_procs),
        namespace_fd=namespace.fd if namespace is not None else None,
        namespace_cwd=namespace.cwd if namespace is not None else None,
        rlimits=pairs,
        uid=uid,
        gid=gid,
    )
    python = sys.executable or shutil.which("python3") or "python3"
    return [python, "-I", "-S", exec_launcher.__file__, spec, "--", *argv]


@dataclass(frozen=True)
class ProcessOutcome:
    """What one bounded run produced.

    Attributes:
        exit_code: Child exit status; negative = killed by that signal.
        output: Kept bytes (head, then tail when truncated) of combined stdout/stderr.
        total_bytes: Bytes the child wrote in all.
        truncated: True when `total_bytes` exceeded the cap and the middle was dropped.
        timed_out: True when the wall-clock limit killed the process group.
        duration_s: Wall-clock seconds from spawn to reap.
        stopped: Why the ``watch`` callback had the process group killed, or None.
    """

    exit_code: int | None
    output: bytes
    total_bytes: int
    truncated: bool
    timed_out: bool
    duration_s: float
    stopped: str | None = None

    def text(self) -> str:
        """Decoded output with a marker where bytes were dropped."""
        return self.output.decode("utf-8", errors="replace")


class OutputCapture:
    """Keep the first 3/4 and the last 1/4 of `max_bytes` of a stream; count the rest."""

    def __init__(self, max_bytes: int) -> None:
        self.tail_cap = max_bytes // 4
        self.head_cap = max_bytes - self.tail_cap
        self.head = bytearray()
        self.tail: deque[bytes] = deque()
        self.tail_len = 0
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if not chunk or self.tail_cap == 0:
            return
        self.tail.append(chunk[-self.tail_cap :])
        self.tail_len += len(self.tail[-1])
        while self.tail_len - len(self.tail[0]) >= self.tail_cap:
            self.tail_len -= len(self.tail.popleft())

    def result(self) -> tuple[bytes, bool]:
        tail = b"".join(self.tail)[-self.tail_cap :] if self.tail_cap else b""
        kept = len(self.head) + len(tail)
        if kept >= self.total:
            return bytes(self.head) + tail, False
        marker = f"\n[... {self.total - kept} bytes of output omitted ...]\n".encode()
        return bytes(self.head) + marker + tail, True


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def run_bounded(
    argv: Sequence[str],
    *,
    cwd: str | os.PathLike[str],
    env: Mapping[str, str],
    timeout_s: float,
    max_output_bytes: int,
    limits: ResourceLimits | None = None,
    uid: int | None = None,
    gid: int | None = None,
    cgroup_procs: Sequence[str] = (),
    watch: Callable[[], str | None] | None = None,
    watch_interval_s: float = 0.1,
    namespace: MountNamespace | None = None,
) -> ProcessOutcome:
    """Run `argv` to completion or until `timeout_s`, whichever comes first.

    The child starts a new session (its pid is the process-group id); on timeout, and after a
    normal exit (to reap background leftovers), the whole group gets SIGKILL. Processes that
    left the group with `setsid` are only caught by an outer isolator (bubblewrap's PID
    namespace). `uid`/`gid` drop privileges (needs root). `cgroup_procs`: ``cgroup.procs``
    files the child joins before it drops privileges (whole-tree memory / pids limits).
    ``watch`` is called every ``watch_interval_s`` while the child runs; a reason it returns
    kills the group and comes back as ``stopped`` (e.g. a workdir over its quota).
    ``namespace``: a mount namespace the child joins before the rlimits and the uid drop
    (a quota volume's). The confinement is applied by the child itself
    (:mod:`~composer_replication.sandbox.exec_launcher`), so starting it never copies this
    process.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if max_output_bytes < 64:
        raise ValueError(f"max_output_bytes must be >= 64, got {max_output_bytes!r}")
    start = time.monotonic()
    deadline = start + timeout_s
    capture = OutputCapture(max_output_bytes)
    pairs = limits.as_rlimits() if limits is not None else []
    group = gid if gid is not None else uid
    confined = bool(pairs or cgroup_procs or uid is not None or namespace is not None)
    if confined:
        argv = _launched(argv, pairs, cgroup_procs, uid, group, namespace)
    proc = subprocess.Popen(
        list(argv),
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        close_fds=True,
        pass_fds=(namespace.fd,) if namespace is not None else (),
    )
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    timed_out = False
    stopped: str | None = None
    next_watch = start + watch_interval_s
    exited_at: float | None = None
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                now = time.monotonic()
                if now >= deadline:
                    timed_out = True
                    break
                if exited_at is None and proc.poll() is not None:
                    exited_at = now
                    _kill_group(proc.pid)  # background children still in the group
                if exited_at is not None and now - exited_at >= _EXIT_GRACE_S:
                    break
                if watch is not None and exited_at is None and now >= next_watch:
                    next_watch = now + watch_interval_s
                    stopped = watch()
                    if stopped is not None:
                        _kill_group(proc.pid)
                        break
                wait = min(deadline - now, 0.05 if exited_at is not None else 0.25)
                if watch is not None:
                    wait = max(0.0, min(wait, next_watch - now))
                if not sel.select(wait):
                    continue
                try:
                    chunk = os.read(fd, _READ_CHUNK)
                except BlockingIOError:
                    continue
                if not chunk:
                    break  # EOF: every writer is gone
                capture.add(chunk)
        if not timed_out and stopped is None:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        _kill_group(proc.pid)
        proc.stdout.close()
        proc.wait()
    output, truncated = capture.result()
    return ProcessOutcome(
        exit_code=proc.returncode,
        output=output,
        total_bytes=capture.total,
        truncated=truncated,
        timed_out=timed_out,
        duration_s=time.monotonic() - start,
        stopped=stopped,
    )


def exec_suffix(outcome: ProcessOutcome, timeout_s: float) -> str:
    """The note appended to an agent-visible output: timeout, signal or non-zero exit."""
    if outcome.stopped:
        return f"\n[stopped: {outcome.stopped}; process group killed]"
    if outcome.timed_out:
        return f"\n[timed out after {timeout_s:g} s; process group killed]"
    if outcome.exit_code is not None and outcome.exit_code < 0:
        return f"\n[killed by signal {-outcome.exit_code}]"
    if outcome.exit_code:
        return f"\n[exit code {outcome.exit_code}]"
    return ""


#: Printed by a sandbox's own shell before the command runs (then removed from the output).
START_MARKER = "composer-replication sandbox started"


def with_start_marker(inner: Sequence[str]) -> list[str]:
    """``inner`` behind a shell that prints ``START_MARKER`` first: output without the marker
    means the sandbox itself failed (no fork, no mount) and the command never ran."""
    return [
        "/bin/sh",
        "-c",
        'printf "%s\\n" "$1"; shift; exec "$@"',
        "sandbox",
        START_MARKER,
        *inner,
    ]


def strip_start_marker(outcome: ProcessOutcome) -> ProcessOutcome | None:
    """``outcome`` without the leading marker, or None when the marker is missing."""
    marker = START_MARKER.encode() + b"\n"
    if not outcome.output.startswith(marker):
        return None
    return dataclasses.replace(
        outcome, output=outcome.output[len(marker) :], total_bytes=outcome.total_bytes - len(marker)
    )
