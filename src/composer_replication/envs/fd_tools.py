"""The tools of a repository task attempt, each ``tool(attempt, arguments) -> observation``.

The editing action space of coding agents (as SWE-agent, arXiv 2405.15793, and OpenHands
give theirs): look at code in pages, find it, change it by exact replacement, and run it.

- ``read_file(path, start_line?, end_line?)``: numbered lines of a file, at most
  ``FDAttempt.page_lines`` lines and ``page_chars`` characters per call; a longer file says
  which lines follow and how to ask for them (never cut in the middle). A directory lists
  its entries.
- ``search(pattern, path?)``: the lines holding ``pattern`` (plain text) in a file or under a
  directory, ``path:line: text``, paged the same way.
- ``replace(path, old, new)``: replace the one occurrence of ``old`` in a file by ``new``;
  ``old`` must occur exactly once (an error says whether it was not found, and the nearest
  line, or where its several occurrences are). The edited region comes back numbered.
- ``create_file(path, content)``: a new file (an existing one is refused: edit it with
  ``replace``).
- ``write_file(path, content)``: replace a file's whole content (not offered by default).
- ``run_tests(tests?)``: the task's test command on some or all tests, in the sandbox: the
  counts, the failing tests and the end of the output.
- ``shell(command)``: a command in the sandbox (optional; bounded by the sandbox's limits).
- ``finish()``: end the attempt.

Every path is resolved (symlinks followed) and must stay inside the attempt's workdir, so
``..``, absolute paths and links pointing outside come back as a ``ToolError`` (an
``Error:`` observation); only regular files with a single hard link are read (at most
``MAX_READ_BYTES``) or replaced; ``run_tests`` accepts test ids, never options. Reads and
edits run on the host; everything the agent's code does runs in the attempt's sandbox.
"""

from __future__ import annotations

import difflib
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_replication.envs.fd_tasks import FDTask
from composer_replication.rollout.agent import Tool
from composer_replication.rollout.tool_calls import ToolError, ToolParameter, ToolResult, ToolSpec
from composer_replication.safety.hack_monitor import Manifest

__all__ = [
    "DEFAULT_TOOLS",
    "FD_TOOLS",
    "MAX_READ_BYTES",
    "MAX_WRITE_CHARS",
    "READING_TOOLS",
    "TOOLS",
    "TOOL_SPECS",
    "FDAttempt",
    "create_file",
    "finish",
    "numbered",
    "occurrences",
    "read_file",
    "replace",
    "replace_function",
    "resolve_in_workdir",
    "run_tests",
    "search",
    "shell",
    "tool_specs",
    "write_file",
]

MAX_READ_BYTES = 200_000
MAX_WRITE_CHARS = 200_000
#: files a search reads at most, and the size of one it still reads
MAX_SEARCH_FILES = 2000
MAX_SEARCH_BYTES = 1_000_000
_SKIP_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", ".pytest_cache", ".tox", ".venv"})
# pytest's progress lines ("....F.   [ 50%]"): the counts say the same in fewer tokens
_PROGRESS_LINE = re.compile(r"[.FEsxX]+\s*(\[\s*\d+%\])?")

TOOL_SPECS: dict[str, ToolSpec] = {
    spec.name: spec
    for spec in (
        ToolSpec(
            "read_file",
            "Show a file's numbered lines, a page at a time, or a folder's entries.",
            (
                ToolParameter("path", "relative to the repository root"),
                ToolParameter("start_line", "the first line", "integer", required=False),
                ToolParameter("end_line", "the last line", "integer", required=False),
            ),
        ),
        ToolSpec(
            "search",
            "Find the lines that contain a text.",
            (
                ToolParameter("pattern", "the exact text"),
                ToolParameter("path", "a file or folder (default: all)", required=False),
            ),
        ),
        ToolSpec(
            "replace",
            "Replace the one occurrence of old in a file by new.",
            (
                ToolParameter("path", "the file"),
                ToolParameter("old", "the exact text, occurring once", raw=True),
                ToolParameter("new", "its replacement", raw=True),
            ),
        ),
        ToolSpec(
            "replace_function",
            "Replace a whole function (or method) definition in a file by new code.",
            (
                ToolParameter("path", "the file"),
                ToolParameter("name", "the function's name, e.g. parse or Parser.parse"),
                ToolParameter(
                    "code",
                    "the new definition, from its def line on (without a docstring, the "
                    "old one is kept)",
                    raw=True,
                ),
            ),
        ),
        ToolSpec(
            "create_file",
            "Create a new file.",
            (
                ToolParameter("path", "the new file"),
                ToolParameter("content", "its text", raw=True),
            ),
        ),
        ToolSpec(
            "write_file",
            "Replace a file's whole text (or create it).",
            (
                ToolParameter("path", "the file"),
                ToolParameter("content", "its new text", raw=True),
            ),
        ),
        ToolSpec(
            "run_tests",
            "Run the tests: all, or the given ones.",
            (
                ToolParameter(
                    "tests", 'test ids or files, e.g. ["tests/test_x.py"]', "array", required=False
                ),
            ),
        ),
        ToolSpec(
            "shell",
            "Run a shell command in the repository (no network).",
            (ToolParameter("command", "the command line"),),
        ),
        ToolSpec("finish", "End the attempt; the repository is then graded.", ()),
    )
}
#: the tools through which an attempt can see the repository's code
READING_TOOLS = frozenset({"read_file", "search", "shell"})
#: the tools an attempt has unless configured otherwise
DEFAULT_TOOLS = ("read_file", "search", "replace", "create_file", "run_tests", "finish")


def tool_specs(names: Sequence[str]) -> tuple[ToolSpec, ...]:
    """The specs of the tools ``names`` (in that order).

    Raises:
        ValueError: an unknown tool name, or no ``finish``.
    """
    unknown = [n for n in names if n not in TOOL_SPECS]
    if unknown:
        raise ValueError(f"unknown tools {unknown}; choose from {', '.join(TOOL_SPECS)}")
    if "finish" not in names:
        raise ValueError(f"tools {list(names)} have no finish: an attempt could never end itself")
    return tuple(TOOL_SPECS[n] for n in dict.fromkeys(names))


#: the default tools' specs (their descriptions as the model reads them)
FD_TOOLS: tuple[ToolSpec, ...] = tool_specs(DEFAULT_TOOLS)


@dataclass
class FDAttempt:
    """The state every tool of one attempt receives.

    Attributes:
        task: The task.
        workdir: This attempt's private copy of the repository.
        sandbox: Runs the tests (and ``shell`` commands) in ``workdir``.
        manifest: The ``HackMonitor`` snapshot taken before the agent acted.
        actions: The file tools' calls (path, content), for the monitor.
        page_lines, page_chars: The most lines / characters one observation shows.
    """

    task: FDTask
    workdir: Path
    sandbox: Any
    manifest: Manifest
    actions: list[dict[str, Any]] = field(default_factory=list)
    page_lines: int = 100
    page_chars: int = 4000


def resolve_in_workdir(workdir: Path, path: Any) -> Path:
    """``path`` (relative, or absolute inside ``workdir``) resolved with symlinks followed;
    a ``ToolError`` when it is not a string or ends up outside ``workdir``."""
    if not isinstance(path, str) or not path.strip() or "\x00" in path:
        raise ToolError(f"path must be a non-empty string, got {path!r}", "bad_arguments")
    root = workdir.resolve()
    target = (root / path.strip()).resolve()  # an absolute `path` replaces root here
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


def _string(arguments: dict[str, Any], key: str, *, empty: bool = True) -> str:
    value = arguments[key]
    if not isinstance(value, str):
        raise ToolError(f"{key} must be a string, got {type(value).__name__}", "bad_arguments")
    if not empty and not value:
        raise ToolError(f"{key} must not be empty", "bad_arguments")
    return value


def _within_write_limit(key: str, text: str) -> None:
    if len(text) > MAX_WRITE_CHARS:
        raise ToolError(
            f"{key} has {len(text)} characters; at most {MAX_WRITE_CHARS}", "bad_arguments"
        )


def _check_regular(target: Path, path: str) -> None:
    """Only plain files: no FIFOs or devices (a read would block or leak), and no file with
    a second hard link (code run in the sandbox could have linked it to one outside)."""
    st = target.stat()
    if not stat.S_ISREG(st.st_mode):
        raise ToolError(f"{path} is not a regular file", "path_error")
    if st.st_nlink > 1:
        raise ToolError(f"{path} has {st.st_nlink} hard links; refusing to touch it", "path_error")


def _read_text(target: Path, path: str) -> str:
    if target.is_dir():
        raise ToolError(f"{path} is a directory, not a file", "path_error")
    if not target.exists():
        raise ToolError(f"{path} does not exist", "path_error")
    _check_regular(target, path)
    with open(target, "rb") as fh:
        data = fh.read(MAX_READ_BYTES + 1)
    if len(data) > MAX_READ_BYTES:
        raise ToolError(f"{path} is larger than {MAX_READ_BYTES} bytes", "path_error")
    return data.decode("utf-8", errors="replace")


def _write_text(target: Path, text: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # O_NOFOLLOW: the path was resolved above; refuse a link planted since then
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)


def _line_number(arguments: dict[str, Any], key: str, default: int) -> int:
    value = arguments.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.strip().isdigit():
            return int(value)
        raise ToolError(f"{key} must be a line number, got {value!r}", "bad_arguments")
    return value


def numbered(lines: Sequence[str], first: int) -> str:
    """``lines`` (without line ends) numbered from ``first``, as ``read_file`` shows them."""
    return "\n".join(f"{first + i:>4}| {line}" for i, line in enumerate(lines))


def _page(lines: Sequence[str], first: int, page_lines: int, page_chars: int) -> int:
    """How many of ``lines`` (from line ``first``) fit one observation."""
    used, n = 0, 0
    for line in lines[:page_lines]:
        cost = len(line) + 7
        if n and used + cost > page_chars:
            break
        used, n = used + cost, n + 1
    return max(n, 1 if lines else 0)


def read_file(attempt: FDAttempt, arguments: dict[str, Any]) -> str:
    """Tool: a page of a file's numbered lines, or a directory's entries."""
    _arguments(arguments, "read_file", ["path"], ["start_line", "end_line"])
    path = arguments["path"]
    attempt.actions.append({"type": "read_file", "path": str(path)})
    target = resolve_in_workdir(attempt.workdir, path)
    if target.is_dir():
        names = sorted(
            p.name + ("/" if p.is_dir() else "")
            for p in target.iterdir()
            if p.name not in _SKIP_DIRS
        )
        return f"{path} is a directory with {len(names)} entries:\n" + "\n".join(names)
    lines = _read_text(target, path).splitlines()
    total = len(lines)
    start = _line_number(arguments, "start_line", 1)
    end = _line_number(arguments, "end_line", total)
    if total == 0:
        return f"{path} is empty"
    if not 1 <= start <= total:
        raise ToolError(f"start_line {start} is outside {path} (lines 1-{total})", "bad_arguments")
    if end < start:
        raise ToolError(f"end_line {end} is before start_line {start}", "bad_arguments")
    wanted = lines[start - 1 : min(end, total)]
    shown = _page(wanted, start, attempt.page_lines, attempt.page_chars)
    last = start + shown - 1
    head = f"{path} (lines {start}-{last} of {total})"
    body = numbered(wanted[:shown], start)
    if last < min(end, total):
        return f"{head}\n{body}\n[lines {last + 1}-{min(end, total)} not shown: call read_file with start_line={last + 1}]"
    return f"{head}\n{body}"


def _search_files(root: Path, target: Path) -> list[Path]:
    if target.is_file():
        return [target]
    found = []
    for dirpath, dirnames, filenames in os.walk(target):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            found.append(Path(dirpath) / name)
            if len(found) >= MAX_SEARCH_FILES:
                return found
    return found


def search(attempt: FDAttempt, arguments: dict[str, Any]) -> str:
    """Tool: the lines holding a plain-text pattern, ``path:line: text``."""
    _arguments(arguments, "search", ["pattern"], ["path"])
    pattern = _string(arguments, "pattern", empty=False)
    where = arguments.get("path") or "."
    attempt.actions.append({"type": "search", "path": str(where)})
    root = attempt.workdir.resolve()
    target = resolve_in_workdir(attempt.workdir, where)
    if not target.exists():
        raise ToolError(f"{where} does not exist", "path_error")
    matches = []
    for file in _search_files(root, target):
        try:
            st = file.lstat()
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SEARCH_BYTES:
            continue
        data = file.read_bytes()
        if b"\x00" in data[:1024]:  # binary
            continue
        rel = file.relative_to(root).as_posix()
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if pattern in line:
                matches.append(f"{rel}:{number}: {line.strip()[:200]}")
    if not matches:
        return f"no line contains {pattern!r} under {where}"
    shown = _page(matches, 1, attempt.page_lines, attempt.page_chars)
    out = f"{len(matches)} lines contain {pattern!r}:\n" + "\n".join(matches[:shown])
    if shown < len(matches):
        out += f"\n[{len(matches) - shown} more not shown: search a narrower path]"
    return out


def occurrences(text: str, old: str) -> list[int]:
    """Every offset where ``old`` starts in ``text``, overlapping ones included (a
    non-overlapping count can miss a second occurrence)."""
    found, at = [], text.find(old) if old else -1
    while at >= 0:
        found.append(at)
        at = text.find(old, at + 1)
    return found


def _nearest_line(text: str, old: str) -> str:
    """Where ``old``'s first line nearly occurs (for the not-found message)."""
    first = next((line for line in old.splitlines() if line.strip()), old).strip()
    lines = text.splitlines()
    best = difflib.get_close_matches(first, [line.strip() for line in lines], n=1, cutoff=0.6)
    if not best:
        return ""
    number = next(i for i, line in enumerate(lines, 1) if line.strip() == best[0])
    return f"; the closest line is {number}: {lines[number - 1]!r} (copy it exactly, indentation included)"


def replace(attempt: FDAttempt, arguments: dict[str, Any]) -> str:
    """Tool: replace the one occurrence of ``old`` in a file by ``new``."""
    _arguments(arguments, "replace", ["path", "old", "new"])
    path = arguments["path"]
    old = _string(arguments, "old", empty=False)
    new = _string(arguments, "new")
    attempt.actions.append({"type": "replace", "path": str(path), "content": new})
    _within_write_limit("new", new)
    target = resolve_in_workdir(attempt.workdir, path)
    text = _read_text(target, path)
    found = occurrences(text, old)
    if not found:
        raise ToolError(f"old does not occur in {path}{_nearest_line(text, old)}", "no_match")
    if len(found) > 1:
        starts = ", ".join(str(text.count("\n", 0, at) + 1) for at in found[:10])
        raise ToolError(
            f"old occurs {len(found)} times in {path} (at lines {starts}); include more of "
            "the surrounding lines so that it occurs once",
            "ambiguous_match",
        )
    at = found[0]
    updated = text[:at] + new + text[at + len(old) :]
    _write_text(target, updated)
    first = text.count("\n", 0, at) + 1
    last = first + new.count("\n")
    lines = updated.splitlines()
    lo, hi = max(1, first - 1), min(len(lines), last + 1)
    return f"replaced in {path}; lines {lo}-{hi} now read:\n{numbered(lines[lo - 1 : hi], lo)}"


def replace_function(attempt: FDAttempt, arguments: dict[str, Any]) -> str:
    """Tool: replace one function's whole definition by new code (indented as the old one;
    written without a docstring, it keeps the old one); code that would leave the file
    unable to compile is refused and nothing changes."""
    from composer_replication.envs.definitions import (
        find_definition,
        source_of,
        with_definition,
        with_docstring,
    )

    _arguments(arguments, "replace_function", ["path", "name", "code"])
    path = arguments["path"]
    name = _string(arguments, "name", empty=False).strip()
    code = _string(arguments, "code", empty=False)
    attempt.actions.append({"type": "replace", "path": str(path), "content": code})
    _within_write_limit("code", code)
    target = resolve_in_workdir(attempt.workdir, path)
    text = _read_text(target, path)
    try:
        definition = find_definition(text, name)
    except LookupError as exc:
        raise ToolError(f"{exc} in {path}", "no_match") from None
    written = with_docstring(code, source_of(text, definition))
    updated = with_definition(text, definition, written)
    try:  # compile, not just parse: a `return` outside the function is refused too
        compile(updated, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        where = f", line {exc.lineno} of {path}" if getattr(exc, "lineno", None) else ""
        message = getattr(exc, "msg", str(exc))
        raise ToolError(
            f"the new code does not compile ({message}{where}); nothing changed",
            "bad_arguments",
        ) from None
    _write_text(target, updated)
    first = definition.first_line
    last = first + len(written.strip("\n").splitlines()) - 1
    lines = updated.splitlines()
    kept = " (its docstring kept)" if written is not code else ""
    return (
        f"replaced {definition.qualname} in {path}{kept}; lines {first}-{last} now read:\n"
        f"{numbered(lines[first - 1 : last], first)}"
    )


def create_file(attempt: FDAttempt, arguments: dict[str, Any]) -> str:
    """Tool: create a new file."""
    _arguments(arguments, "create_file", ["path", "content"])
    path = arguments["path"]
    content = _string(arguments, "content")
    attempt.actions.append({"type": "create_file", "path": str(path), "content": content})
    _within_write_limit("content", content)
    target = resolve_in_workdir(attempt.workdir, path)
    if target.exists() or target.is_symlink():
        raise ToolError(f"{path} already exists; change it with replace", "path_error")
    _write_text(target, content)
    return f"created {path} ({len(content.splitlines())} lines)"


def write_file(attempt: FDAttempt, arguments: dict[str, Any]) -> str:
    """Tool: replace (or create) a file's whole content."""
    _arguments(arguments, "write_file", ["path", "content"])
    path, content = arguments["path"], arguments["content"]
    attempt.actions.append({"type": "write_file", "path": str(path), "content": str(content)})
    if not isinstance(content, str):
        raise ToolError(f"content must be a string, got {type(content).__name__}", "bad_arguments")
    _within_write_limit("content", content)
    target = resolve_in_workdir(attempt.workdir, path)
    if target.exists():
        _check_regular(target, path)
    _write_text(target, content)
    return f"wrote {len(content)} characters to {path}"


def _test_ids(attempt: FDAttempt, arguments: dict[str, Any]) -> list[str]:
    tests = arguments.get("tests") or []
    if isinstance(tests, str):
        tests = [tests]
    if not isinstance(tests, list) or not all(isinstance(t, str) and t for t in tests):
        raise ToolError(f"tests must be a list of test ids, got {tests!r}", "bad_arguments")
    for test in tests:
        if test.startswith("-"):
            raise ToolError(f"{test!r} is an option; pass test ids or files only", "bad_arguments")
        resolve_in_workdir(attempt.workdir, test.split("::", 1)[0])
    return tests


def _tail(text: str, limit: int) -> str:
    text = text.strip()
    if len(text) <= limit:
        return text
    cut = text[-limit:]
    newline = cut.find("\n")
    if 0 <= newline < limit // 2:
        cut = cut[newline + 1 :]
    return f"[the first {len(text) - len(cut)} characters of the output not shown]\n{cut}"


def run_tests(attempt: FDAttempt, arguments: dict[str, Any]) -> ToolResult:
    """Tool: the task's test command (optionally on some tests) in the sandbox; the
    counts, the failing tests and the end of the output. ``info``: the counts and how many
    of the task's target tests passed."""
    _arguments(arguments, "run_tests", [], ["tests"])
    tests = _test_ids(attempt, arguments)
    result = attempt.sandbox.run_tests(attempt.task.test_command, tests)
    summary = f"{result.passed} passed, {result.failed} failed, {result.errors} errors"
    targets = attempt.task.target_tests
    info = {
        "passed": result.passed,
        "failed": result.failed,
        "errors": result.errors,
        "target_passed": sum(result.outcomes.get(t) == "passed" for t in targets),
        "n_targets": len(targets),
    }
    if result.timed_out:
        raise ToolError(
            f"the test run timed out ({summary})\n{_tail(result.output, 1000)}", "timeout", info
        )
    failing = [t for t, outcome in result.outcomes.items() if outcome in ("failed", "error")]
    output = "\n".join(
        line for line in result.output.splitlines() if not _PROGRESS_LINE.fullmatch(line)
    )
    lines = [summary]
    if failing:
        listed = ", ".join(failing[:10]) + (
            f" and {len(failing) - 10} more" if len(failing) > 10 else ""
        )
        lines.append(f"failing: {listed}")
    room = max(200, attempt.page_chars - sum(len(x) + 1 for x in lines))
    lines.append(_tail(output, room))
    return ToolResult("\n".join(lines), info)


def shell(attempt: FDAttempt, arguments: dict[str, Any]) -> str:
    """Tool: a command in the sandbox (its limits and denylist apply)."""
    _arguments(arguments, "shell", ["command"])
    command = _string(arguments, "command", empty=False)
    attempt.actions.append({"type": "shell", "command": command})
    if not attempt.sandbox.is_command_allowed(command):
        raise ToolError(f"the command {command.split()[0]!r} is not allowed here", "tool_error")
    return _tail(attempt.sandbox.exec({"command": command}), attempt.page_chars) or "(no output)"


def finish(attempt: FDAttempt, arguments: dict[str, Any]) -> str:
    """Tool: end the attempt."""
    return "finished; grading the repository"


TOOLS: dict[str, Tool] = {
    "read_file": read_file,
    "search": search,
    "replace": replace,
    "replace_function": replace_function,
    "create_file": create_file,
    "write_file": write_file,
    "run_tests": run_tests,
    "shell": shell,
    "finish": finish,
}
