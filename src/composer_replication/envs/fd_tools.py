"""The tools of a ``feature_deletion`` attempt: ``read_file``, ``write_file``, ``run_tests``
and ``finish``, each ``tool(attempt, arguments) -> observation``.

Every path is resolved (symlinks followed) and must stay inside the attempt's workdir, so
``..``, absolute paths and links pointing outside come back as a ``ToolError`` (an
``Error:`` observation); only regular files with a single hard link are read (at most
``MAX_READ_BYTES``) or replaced; ``run_tests`` accepts test ids, never pytest options. Reads
and writes run on the host; the tests run in the attempt's sandbox.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_replication.envs.fd_tasks import FDTask
from composer_replication.rollout.agent import Tool
from composer_replication.rollout.tool_calls import ToolError, ToolSpec
from composer_replication.safety.hack_monitor import Manifest

__all__ = [
    "FD_TOOLS",
    "MAX_READ_BYTES",
    "MAX_WRITE_CHARS",
    "TOOLS",
    "FDAttempt",
    "finish",
    "read_file",
    "resolve_in_workdir",
    "run_tests",
    "write_file",
]

MAX_READ_BYTES = 200_000
MAX_WRITE_CHARS = 200_000
FD_TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec("read_file", "Return the text of a file.", (("path", "the file's path"),)),
    ToolSpec(
        "write_file",
        "Replace a file's whole content (the file is created if it does not exist).",
        (("path", "the file's path"), ("content", "the complete new text of the file")),
    ),
    ToolSpec(
        "run_tests",
        "Run the test suite and return pytest's output.",
        (("tests", 'optional list of test ids or files, e.g. ["tests/test_x.py::test_y"]'),),
    ),
    ToolSpec("finish", "End the attempt; the repository is then graded.", ()),
)


@dataclass
class FDAttempt:
    """The state every tool of one attempt receives.

    Attributes:
        task: The task.
        workdir: This attempt's private copy of the stubbed repository.
        sandbox: Runs the tests in ``workdir``.
        manifest: The ``HackMonitor`` snapshot taken before the agent acted.
        actions: ``read_file`` / ``write_file`` calls (path, content), for the monitor.
    """

    task: FDTask
    workdir: Path
    sandbox: Any
    manifest: Manifest
    actions: list[dict[str, Any]] = field(default_factory=list)


def resolve_in_workdir(workdir: Path, path: Any) -> Path:
    """``path`` (relative, or absolute inside ``workdir``) resolved with symlinks followed;
    a ``ToolError`` when it is not a string or ends up outside ``workdir``."""
    if not isinstance(path, str) or not path.strip() or "\x00" in path:
        raise ToolError(f"path must be a non-empty string, got {path!r}", "bad_arguments")
    root = workdir.resolve()
    target = (root / path).resolve()  # an absolute `path` replaces root here
    if target != root and root not in target.parents:
        raise ToolError(
            f"path {path!r} is outside the repository; use a path relative to its root",
            "path_error",
        )
    return target


def _arguments(
    arguments: dict[str, Any], tool: str, required: Sequence[str], optional: Sequence[str] = ()
) -> None:
    missing = [k for k in required if k not in arguments]
    extra = sorted(set(arguments) - set(required) - set(optional))
    if missing or extra:
        takes = ", ".join([*required, *(f"{k} (optional)" for k in optional)]) or "no arguments"
        raise ToolError(
            f"{tool} got missing {missing} / unexpected {extra} arguments; it takes {takes}",
            "bad_arguments",
        )


def _check_regular(target: Path, path: str) -> None:
    """Only plain files: no FIFOs or devices (a read would block or leak), and no file with
    a second hard link (code run in the sandbox could have linked it to one outside)."""
    st = target.stat()
    if not stat.S_ISREG(st.st_mode):
        raise ToolError(f"{path} is not a regular file", "path_error")
    if st.st_nlink > 1:
        raise ToolError(f"{path} has {st.st_nlink} hard links; refusing to touch it", "path_error")


def read_file(attempt: FDAttempt, arguments: dict[str, Any]) -> str:
    """Tool: the text of a file inside the workdir."""
    _arguments(arguments, "read_file", ["path"])
    path = arguments["path"]
    attempt.actions.append({"type": "read_file", "path": str(path)})
    target = resolve_in_workdir(attempt.workdir, path)
    if target.is_dir():
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in target.iterdir())
        raise ToolError(f"{path} is a directory; it contains: {', '.join(names)}", "path_error")
    if not target.exists():
        raise ToolError(f"{path} does not exist", "path_error")
    _check_regular(target, path)
    with open(target, "rb") as fh:
        data = fh.read(MAX_READ_BYTES + 1)
    text = data[:MAX_READ_BYTES].decode("utf-8", errors="replace")
    return text + ("\n[file truncated]" if len(data) > MAX_READ_BYTES else "")


def write_file(attempt: FDAttempt, arguments: dict[str, Any]) -> str:
    """Tool: replace (or create) a file inside the workdir."""
    _arguments(arguments, "write_file", ["path", "content"])
    path, content = arguments["path"], arguments["content"]
    attempt.actions.append({"type": "write_file", "path": str(path), "content": str(content)})
    if not isinstance(content, str):
        raise ToolError(f"content must be a string, got {type(content).__name__}", "bad_arguments")
    if len(content) > MAX_WRITE_CHARS:
        raise ToolError(f"content has {len(content)} characters; at most {MAX_WRITE_CHARS}")
    target = resolve_in_workdir(attempt.workdir, path)
    if target.exists():
        _check_regular(target, path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # O_NOFOLLOW: the path was resolved above; refuse a link planted since then
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(content)
    return f"wrote {len(content)} characters to {path}"


def run_tests(attempt: FDAttempt, arguments: dict[str, Any]) -> str:
    """Tool: the task's test command (optionally on some tests) in the sandbox."""
    _arguments(arguments, "run_tests", [], ["tests"])
    tests = arguments.get("tests") or []
    if isinstance(tests, str):
        tests = [tests]
    if not isinstance(tests, list) or not all(isinstance(t, str) and t for t in tests):
        raise ToolError(f"tests must be a list of test ids, got {tests!r}", "bad_arguments")
    for test in tests:
        if test.startswith("-"):
            raise ToolError(f"{test!r} is an option; pass test ids or files only", "bad_arguments")
        resolve_in_workdir(attempt.workdir, test.split("::", 1)[0])
    result = attempt.sandbox.run_tests(attempt.task.test_command, tests)
    summary = f"{result.passed} passed, {result.failed} failed, {result.errors} errors"
    if result.timed_out:
        raise ToolError(f"the test run timed out ({summary})\n{result.output}", "timeout")
    return f"{summary}\n{result.output}"


def finish(attempt: FDAttempt, arguments: dict[str, Any]) -> str:
    """Tool: end the attempt."""
    return "finished; grading the repository"


TOOLS: dict[str, Tool] = {
    "read_file": read_file,
    "write_file": write_file,
    "run_tests": run_tests,
    "finish": finish,
}
