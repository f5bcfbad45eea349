"""The first program of every sandboxed child: it confines itself, then becomes the command.

``run_bounded`` starts a child without running Python code between fork and exec, so
CPython can start it with ``vfork`` (the parent's page tables are not copied). A plain
``fork`` from a process holding gigabytes of tensors costs more than the command it runs:
the kernel copies the parent's page tables, and every page the parent writes afterwards
takes a copy-on-write fault (measured: 185 ms of system time per spawn with 1 GB held).
This script is what the child executes instead: in order it joins the given cgroups
(``cgroup.procs``), enters a mount namespace and its working directory, sets rlimits, drops
to a uid/gid, and ``exec``s the command. Nothing before the ``exec`` is left running.

Run as ``python -I -S exec_launcher.py SPEC -- ARGV...`` with ``SPEC`` the JSON of
:func:`launch_spec`; it imports only the standard library. A step that fails is reported on
stderr ("sandbox error: ...") with exit code 126 (127: the command could not be executed),
before the command's start marker, so the sandbox counts it as an infrastructure error.
"""

from __future__ import annotations

import json
import os
import resource
import sys

LAUNCH_FAILED = 126
EXEC_FAILED = 127
_CLONE_NEWNS = 0x00020000


def launch_spec(
    *,
    cgroup_procs: list[str],
    namespace_fd: int | None,
    namespace_cwd: str | None,
    rlimits: list[tuple[int, int]],
    uid: int | None,
    gid: int | None,
) -> str:
    """The launcher's first argument: what the child does to itself before ``exec``."""
    return json.dumps(
        {
            "cgroup_procs": list(cgroup_procs),
            "namespace_fd": namespace_fd,
            "namespace_cwd": namespace_cwd,
            "rlimits": [list(pair) for pair in rlimits],
            "uid": uid,
            "gid": gid,
        }
    )


def _enter_namespace(fd: int, cwd: str | None) -> None:
    setns = getattr(os, "setns", None)  # Python >= 3.12
    if setns is not None:
        setns(fd, _CLONE_NEWNS)
    else:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNS) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    os.close(fd)
    if cwd is not None:
        os.chdir(cwd)


def confine(spec: dict) -> None:
    """Apply ``spec`` to this process (cgroups, namespace, rlimits, then identity)."""
    for procs in spec["cgroup_procs"]:
        fd = os.open(procs, os.O_WRONLY)
        try:
            os.write(fd, b"0")  # 0 moves the writing process itself
        finally:
            os.close(fd)
    if spec["namespace_fd"] is not None:
        _enter_namespace(spec["namespace_fd"], spec["namespace_cwd"])
    for res, value in spec["rlimits"]:
        resource.setrlimit(res, (value, value))
    if spec["uid"] is not None:
        gid = spec["gid"] if spec["gid"] is not None else spec["uid"]
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(spec["uid"], spec["uid"], spec["uid"])


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        sys.stderr.write("sandbox error: usage: exec_launcher.py SPEC -- ARGV...\n")
        return LAUNCH_FAILED
    try:
        confine(json.loads(argv[0]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        sys.stderr.write(f"sandbox error: could not confine the command: {exc}\n")
        return LAUNCH_FAILED
    command = argv[2:]
    sys.stderr.flush()
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        sys.stderr.write(f"sandbox error: could not start {command[0]!r}: {exc}\n")
        return EXEC_FAILED
    return EXEC_FAILED  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
