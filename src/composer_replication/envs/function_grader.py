"""Grading a function task without trusting anything the candidate can touch.

The candidate's code runs in the sandbox; the verdict is formed here. The task's hidden
tests run in THIS process, with the entry point bound to a proxy: each call the tests make
goes to the sandbox as plain-data arguments (``plain_data``), the harness
(``function_harness``) calls the candidate there and reports the result as plain data, and
the test's own ``assert`` compares built-in values here. The tests and their expected values
never enter the sandbox; the reward counts which of the task's named tests ran to the end
here, not what the candidate reports.

Calls are gathered in rounds: the tests run until each needs a result not yet known (it
stops at that call), the new calls run in one sandbox process, and the tests run again with
the answers (a test that calls the function with an earlier result needs a second round).

The candidate's workdir is read-only and the report travels on the harness's stdout, each
record behind a prefix; lines the candidate prints itself are ignored, and report lines it
forges (unknown calls, repeats, malformed lines) are flagged. Fail closed: a sandbox that
times out, a harness that crashes or leaves no report, or a report for fewer calls than
asked gives reward 0 with an error. A sandbox that never started the harness is an infrastructure
error (``GradeResult.infrastructure``): the rollout is excluded from training, not charged
to the policy. What the candidate left in its workdir beside its answer (new or changed
files, links, FIFOs) is recorded as hack flags.
"""

from __future__ import annotations

import builtins
import json
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_replication.envs import plain_data
from composer_replication.envs.function_harness import HARNESS_MARKER, RECORD_PREFIX
from composer_replication.envs.plain_data import PlainDataError, decode, encode

__all__ = [
    "GradeResult",
    "grade_function",
    "hidden_from_candidates",
    "workdir_snapshot",
]

HARNESS = "_harness.py"
CODEC = "_plain.py"
CALLS = "calls.json"
SOLUTION = "solution.py"
# Each round is one sandbox process; a test that calls the function in a loop learns one new
# call per round, so the bound is generous (the tests, not the candidate, set the count).
MAX_ROUNDS = 64
#: Output kept per sandbox round (results travel on stdout); a larger report is cut and
#: then counts as missing.
MAX_REPORT_BYTES = 8 * 1024 * 1024

_HARNESS_SOURCE = Path(__file__).with_name("function_harness.py").read_text(encoding="utf-8")
_CODEC_SOURCE = Path(plain_data.__file__).read_text(encoding="utf-8")


@dataclass
class GradeResult:
    """The verdict on one candidate.

    Attributes:
        reward: passed / number of the task's tests (0 on any error).
        passed / total: tests that ran to the end here, and the task's test count.
        feedback: failing tests and what the candidate returned (the SDPO error site).
        error: why the candidate got 0 regardless of its answers (timeout, crash, missing
            report, ...), or None.
        infrastructure: the sandbox failed before the candidate ran (not the policy's fault).
        flags: what the candidate did outside its answer (hack flags).
    """

    reward: float
    passed: int
    total: int
    feedback: str | None = None
    error: str | None = None
    infrastructure: bool = False
    flags: list[str] = field(default_factory=list)


class _Pending(Exception):
    """A test reached a call whose result is not known yet."""


class _CandidateRaised(Exception):
    """The candidate raised an exception that is not a built-in one."""


def _raised(name: str, message: str) -> BaseException:
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        return kind(message)
    return _CandidateRaised(f"{name}: {message}")


def _write_back(before: list[Any], after: list[Any]) -> None:
    """Mutations the candidate made to mutable arguments, applied to the test's objects."""
    for old, new in zip(before, after):
        if type(old) is list and type(new) is list:
            old[:] = new
        elif (type(old) is dict and type(new) is dict) or (type(old) is set and type(new) is set):
            old.clear()
            old.update(new)


class _Proxy:
    """The entry point as the tests see it: answers from ``known``, else asks for a call."""

    def __init__(self, name: str, known: dict[str, dict], pending: dict[str, list]) -> None:
        self.__name__ = name
        self.known, self.pending = known, pending
        self.seen: list[str] = []  # "f(args) returned x" of the current test, for feedback

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError("the grading channel passes positional arguments only")
        encoded = encode(list(args))
        key = json.dumps(encoded, sort_keys=True)
        if key not in self.known:
            self.pending.setdefault(key, encoded)
            raise _Pending(key)
        answer = self.known[key]
        shown = f"{self.__name__}({', '.join(_short(a) for a in args)})"
        if "raised" in answer:
            self.seen.append(f"{shown} raised {answer['raised']}: {answer.get('message', '')}")
            raise _raised(answer["raised"], answer.get("message", ""))
        if "unencodable" in answer:
            raise AssertionError(f"{shown} returned a value that is not plain data")
        _write_back(list(args), decode(answer["args_after"]))
        result = decode(answer["result"])
        self.seen.append(f"{shown} returned {_short(result)}")
        return result


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _failure(task: Any, name: str, exc: BaseException, seen: list[str]) -> str:
    """A pytest-like failure report: the failing line and what the candidate returned."""
    import traceback

    head = f"FAILED {name} - {type(exc).__name__}" + (f": {exc}" if str(exc) else "")
    lines = [head]
    filename = f"<tests of {task.task_id}>"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == filename]
    if frames:
        source = task.tests.splitlines()
        if 0 < frames[-1].lineno <= len(source):
            lines.append(f"    {source[frames[-1].lineno - 1].strip()}")
    lines += [f"    where {call}" for call in seen[-3:]]
    return "\n".join(lines)


def _run_tests(task: Any, proxy: _Proxy) -> tuple[list[str], list[str], bool]:
    """(passed test names, failure lines, any test still waiting for a call)."""
    namespace: dict[str, Any] = {"__builtins__": builtins, "__name__": "hidden_tests"}
    exec(compile(task.tests, f"<tests of {task.task_id}>", "exec"), namespace)  # our own code
    namespace[task.entry_point] = proxy
    passed, failures, waiting = [], [], False
    for name in task.test_names:
        proxy.seen = []
        try:
            namespace[name]()
        except _Pending:
            waiting = True
        except Exception as exc:  # AssertionError, or what the candidate's call raised
            failures.append(_failure(task, name, exc, proxy.seen))
        else:
            passed.append(name)
    return passed, failures, waiting


def hidden_from_candidates() -> tuple[str, ...]:
    """Host directories a candidate's sandbox must not see: this package (its task banks
    and hidden tests) and, for a source checkout, the whole checkout (its git history holds
    the same files)."""
    package = Path(__file__).resolve().parents[1]
    if package.parent.name == "src" and (package.parent.parent / "pyproject.toml").is_file():
        return (str(package.parent.parent),)
    return (str(package),)


def workdir_snapshot(workdir: Path) -> dict[str, tuple[int, int, int]]:
    """name -> (mode, size, mtime_ns) of every entry, by lstat (never opens anything)."""
    out = {}
    for root, dirs, files in os.walk(workdir, followlinks=False):
        for name in [*dirs, *files]:
            path = Path(root, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            out[str(path.relative_to(workdir))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def _behaviour_flags(before: dict, after: dict) -> list[str]:
    flags = []
    for name, (mode, _, _) in sorted(after.items()):
        if name not in before:
            kind = "link" if stat.S_ISLNK(mode) else "fifo" if stat.S_ISFIFO(mode) else "file"
            flags.append(f"created {kind} {name}")
        elif after[name] != before[name]:
            flags.append(f"changed {name}")
    flags += [f"deleted {name}" for name in sorted(set(before) - set(after))]
    return flags


_EXITS = ("SystemExit", "KeyboardInterrupt", "GeneratorExit")
# What the OS says when the candidate reaches for what it may not touch (read-only workdir
# and root, hidden directories, other uids' files).
_FORBIDDEN = {
    "Read-only file system": "tried to write outside its answer (read-only file system)",
    "Permission denied": "tried a file operation it has no permission for",
    "Operation not permitted": "tried an operation that is not permitted",
}


def _add(flags: list[str], new: list[str]) -> None:
    flags += [f for f in new if f not in flags]


def _output_flags(output: str) -> list[str]:
    """Flags from the candidate's own output: the OS refusing what it tried."""
    text = "\n".join(line for line in output.splitlines() if not line.startswith(RECORD_PREFIX))
    return [flag for needle, flag in _FORBIDDEN.items() if needle in text]


def _parse_results(output: str, wanted: set[str], flags: list[str]) -> tuple[dict, dict[str, dict]]:
    """(load header, id -> answer) from the report lines in the output; the first record
    of each id counts, and anything odd about the report is flagged."""
    header: dict[str, Any] = {}
    answers: dict[str, dict] = {}
    odd: set[str] = set()
    for line in output.splitlines():
        if not line.startswith(RECORD_PREFIX):
            continue
        try:
            record = json.loads(line[len(RECORD_PREFIX) :])
        except (json.JSONDecodeError, RecursionError):
            odd.add("malformed report lines")
            continue
        if type(record) is not dict:
            odd.add("malformed report lines")
        elif "loaded" in record:
            if header:
                odd.add("report claimed loading twice")
            header = header or record
        elif record.get("id") not in wanted:
            odd.add("report lines for calls never made")
        elif record["id"] in answers:
            odd.add("several reports for one call")
        else:
            answers[record["id"]] = record
    flags += sorted(f"forged report: {o}" for o in odd if f"forged report: {o}" not in flags)
    return header, answers


def grade_function(
    task: Any,
    code: str,
    sandbox_factory: Any,
    *,
    feedback_chars: int = 1500,
) -> GradeResult:
    """Grade ``code`` (the candidate's source) on ``task``'s hidden tests. Never raises."""
    total = task.n_tests
    known: dict[str, dict] = {}
    flags: list[str] = []
    workdir = Path(tempfile.mkdtemp(prefix="cr-grade-"))
    try:
        os.chmod(workdir, 0o755)  # the sandbox uid must be able to enter it
        (workdir / SOLUTION).write_text(code, encoding="utf-8")
        (workdir / HARNESS).write_text(_HARNESS_SOURCE, encoding="utf-8")
        (workdir / CODEC).write_text(_CODEC_SOURCE, encoding="utf-8")
        sandbox = sandbox_factory(workdir)
        for _ in range(MAX_ROUNDS):
            pending: dict[str, list] = {}
            passed, failures, waiting = _run_tests(task, _Proxy(task.entry_point, known, pending))
            if not waiting:
                return _verdict(passed, failures, total, flags, feedback_chars)
            outcome = _sandbox_round(sandbox, workdir, task, pending, known, flags)
            if outcome is not None:
                return outcome
        return GradeResult(0.0, 0, total, None, "too many call rounds", flags=flags)
    except Exception as exc:  # a failing grader is data, not a crash
        return GradeResult(
            0.0, 0, total, None, f"sandbox: {type(exc).__name__}: {exc}", True, flags
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _sandbox_round(
    sandbox: Any,
    workdir: Path,
    task: Any,
    pending: dict[str, list],
    known: dict[str, dict],
    flags: list[str],
) -> GradeResult | None:
    """Run the pending calls in one sandbox process; None when every answer came back."""
    ids = {key: str(i) for i, key in enumerate(pending)}
    calls = [{"id": ids[key], "args": args} for key, args in pending.items()]
    calls_file = workdir / CALLS
    calls_file.write_text(json.dumps({"entry_point": task.entry_point, "calls": calls}))
    os.chmod(calls_file, 0o644)  # readable by the sandbox uid
    before = workdir_snapshot(workdir)
    output = sandbox.exec({"command": f"python {HARNESS}"})
    trail = sandbox.trajectory()  # every Sandbox records its commands
    log = trail[-1] if trail else {}
    flags += [f for f in _behaviour_flags(before, workdir_snapshot(workdir)) if f not in flags]
    zero = GradeResult(0.0, 0, task.n_tests, flags=flags)
    if HARNESS_MARKER not in output:  # the harness never ran: not the candidate's doing
        reason = log.get("infrastructure_error") or output[-300:]
        zero.error, zero.infrastructure = f"sandbox did not start: {reason!r}", True
        return zero
    header, answers = _parse_results(output, set(ids.values()), flags)
    _add(flags, _output_flags(output))
    if header.get("loaded") is False and str(header.get("error", "")).startswith(_EXITS):
        _add(flags, ["exited while being imported"])
    if log.get("timed_out"):
        zero.error = "timeout"
    elif log.get("exit_code") not in (0, None):
        zero.error = f"crash: the harness exited with {log.get('exit_code')}"
    elif header.get("loaded") is False:
        zero.feedback = f"Importing the solution failed: {header.get('error', '')}"
        return zero
    elif header.get("loaded") is not True:
        zero.error = "missing report"
    elif len(answers) < len(ids):
        zero.error = f"missing report for {len(ids) - len(answers)} of {len(ids)} calls"
    if zero.error:
        zero.feedback = f"The solution could not be graded: {zero.error}."
        return zero
    for key, call_id in ids.items():
        answer = answers[call_id]
        try:  # a result the grader cannot rebuild counts as not plain data
            if "result" in answer:
                decode(answer["result"])
                decode(answer["args_after"])
        except (PlainDataError, KeyError, TypeError, ValueError, RecursionError):
            answer = {"unencodable": "bad encoding"}
        if "unencodable" in answer:
            _add(flags, ["returned a value that is not plain data (a custom __eq__?)"])
        if "raised" in answer:
            _add(flags, _output_flags(str(answer.get("message", ""))))
        known[key] = answer
    return None


def _verdict(
    passed: list[str], failures: list[str], total: int, flags: list[str], feedback_chars: int
) -> GradeResult:
    reward = len(passed) / total if total else 0.0
    feedback = None if not failures else "\n".join(failures)[-feedback_chars:]
    return GradeResult(reward, len(passed), total, feedback, None, False, flags)
