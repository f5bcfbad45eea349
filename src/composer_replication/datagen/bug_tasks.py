"""Bug-fix tasks: a small bug injected into a covered function, to be found and fixed.

The bugs are SWE-smith's procedural modifications of a function's AST (arXiv 2504.21798:
flipped or changed operators, swapped operands, changed constants, off-by-one bounds,
inverted if/else, removed conditionals, assignments, loops or wrappers, shuffled lines,
broken chains; ``datagen.bug_kinds``), each candidate one :class:`Modification` whose hidden
reference is the inverse patch (the function as it was). ``combined`` adds candidates of two
bugs in different functions of one file. A candidate becomes a task only through the
solvability gates, like every repository task: it must break tests that passed before
(its FAIL_TO_PASS tests) and the inverse patch must restore them.

The problem statement is written from the failing tests alone (:func:`problem_statement`),
never from the patch: the failing tests' names, what they reported (the ``E`` lines of the
assertion or exception) and the innermost frame of the traceback inside the repository's
own code (file, line, function and the line of code there), as a bug report would; below
it, the function the failures point at as the work tree has it (:func:`failing_code`: the
innermost frame's function, or the function the failing line calls), so an agent can fix
it at once.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from composer_replication.datagen.bug_kinds import BUG_KINDS, Bug, combine, find_bugs
from composer_replication.datagen.modification import Modification
from composer_replication.envs.fd_tasks import TaskReference, make_task_id
from composer_replication.safety.hack_monitor import is_protected
from composer_replication.safety.holdout import HeldoutSplit

__all__ = [
    "KIND",
    "FailingCode",
    "Frame",
    "bug_candidates",
    "bug_prompt",
    "failing_code",
    "innermost_frame",
    "problem_statement",
]

#: the task kind bug-fix tasks record
KIND = "bug"
#: failing tests a problem statement shows in full (the rest are named)
SHOWN_FAILURES = 2
_LOCATION = re.compile(r"^(?P<path>[^\s:][^:]*\.py):(?P<line>\d+): ?(?P<rest>.*)$")
_SEPARATOR = re.compile(r"^(_ ){3,}_?$")
_DEF = re.compile(r"^\s*(?:async\s+)?def\s+(?P<name>[A-Za-z_]\w*)\s*\(")


def _modification(
    repo_name: str, bug: Bug, function: str | None = None, sites: tuple[int, ...] = ()
) -> Modification:
    """The candidate of ``bug``; ``function``: the function whose deletion id groups it for
    the held-out split (default: the bug's own; a combined bug's: its first function's);
    ``sites``: the lines it changes (default: the bug's line)."""
    function = function or bug.qualname
    original = bug.original.splitlines(keepends=True)
    buggy = bug.buggy.splitlines(keepends=True)
    reference = TaskReference(
        task_id="",
        file=bug.file,
        start_line=bug.start_line,
        end_line=bug.buggy_end_line,
        stub="".join(buggy[bug.start_line - 1 : bug.buggy_end_line]),
        body="".join(original[bug.start_line - 1 : bug.end_line]),
    )
    return Modification(
        # the function's deletion id before the '#': both kinds of one function split alike
        task_id=f"{make_task_id(repo_name, bug.file, function)}#bug:{bug.bug_id}",
        kind=KIND,
        file=bug.file,
        qualname=bug.qualname,
        name=function.rsplit(".", 1)[-1],
        changed={bug.file: bug.buggy},
        original={bug.file: bug.original},
        reference=reference,
        lines=(bug.start_line, bug.buggy_end_line),
        sites=sites or (bug.line,),
        detail=bug.description,
        bug_kind=bug.kind,
    )


def bug_candidates(
    base: Path,
    repo_name: str,
    *,
    exclude: Collection[str] = (),
    kinds: Collection[str] = BUG_KINDS,
    per_function: int = 2,
    combined: int = 0,
    seed: int = 0,
    split: HeldoutSplit | None = None,
) -> list[Modification]:
    """Bug candidates in the repository copy ``base``: up to ``per_function`` single bugs of
    ``kinds`` per candidate function, and ``combined`` pairs of bugs in two functions of one
    file (two functions ``split`` puts on the same side: a pair never trains on a function
    held out); in an order shuffled by ``seed`` (so the first tasks accepted come from
    across the repository, not from its first file). ``exclude``: files never changed.

    Raises:
        ValueError: an unknown bug kind.
    """
    unknown = sorted(set(kinds) - set(BUG_KINDS))
    if unknown:
        raise ValueError(f"unknown bug kinds {unknown}; use some of {', '.join(BUG_KINDS)}")
    bugs = find_bugs(base, exclude=exclude, kinds=kinds, per_function=per_function, seed=seed)
    rng = random.Random(f"bugs:{seed}")
    singles = [_modification(repo_name, bug) for bug in bugs]
    pairs = []
    if combined:
        by_file: dict[str, list[Bug]] = {}
        for bug in bugs:
            by_file.setdefault(bug.file, []).append(bug)

        def side(bug: Bug) -> bool:
            task = make_task_id(repo_name, bug.file, bug.qualname)
            return split is not None and split.is_heldout(task)

        options = [
            (a, b)
            for file_bugs in by_file.values()
            for i, a in enumerate(file_bugs)
            for b in file_bugs[i + 1 :]
            if a.qualname != b.qualname
            and (a.end_line < b.start_line or b.end_line < a.start_line)
            and side(a) == side(b)
        ]
        for a, b in rng.sample(options, min(combined, len(options))):
            first = min((a, b), key=lambda bug: bug.start_line)
            pairs.append(_modification(repo_name, combine(a, b), first.qualname, (a.line, b.line)))
    found = singles + pairs
    rng.shuffle(found)
    return found


@dataclass(frozen=True)
class Frame:
    """A traceback frame in the repository's code: where a failing test's error came from."""

    path: str
    line: int
    function: str | None
    code: str | None


def _entries(text: str) -> list[list[str]]:
    """A pytest traceback's entries (the ``_ _ _`` lines separate them)."""
    entries: list[list[str]] = [[]]
    for line in text.splitlines():
        if _SEPARATOR.match(line.strip()):
            entries.append([])
        else:
            entries[-1].append(line)
    return [e for e in entries if e]


def innermost_frame(
    text: str, is_repository_code: Callable[[str], bool] | None = None
) -> Frame | None:
    """The innermost frame of a pytest traceback (a failure's text) whose file is the
    repository's own code (``is_repository_code(path)``; default: a relative path that is
    not a test or configuration file); None when the error never left the tests."""
    check = is_repository_code or _repository_code
    found: Frame | None = None
    for entry in _entries(text):
        for k, line in enumerate(entry):
            match = _LOCATION.match(line)
            if match is None or not check(match["path"]):
                continue
            rest = match["rest"].strip()
            function = rest[3:].strip() if rest.startswith("in ") else None
            code = None
            for earlier in reversed(entry[:k]):
                if function is None and _DEF.match(earlier.lstrip("> ")):
                    function = _DEF.match(earlier.lstrip("> "))["name"]
                if code is None and earlier.startswith(">"):
                    code = earlier[1:].strip()
            if code is None and k + 1 < len(entry) and entry[k + 1].startswith("    "):
                code = entry[k + 1].strip()  # the short form: the code follows its location
            found = Frame(match["path"], int(match["line"]), function, code)
    return found


def _repository_code(path: str) -> bool:
    return not path.startswith(("/", "..", "<")) and not is_protected(path)


def _reported(text: str, most: int = 3) -> list[str]:
    """What the test run reported of a failure: its first ``E`` lines."""
    lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    return [line for line in lines if line][:most]


def _failing_line(text: str) -> str | None:
    """The test's own line that failed (the first ``>`` line of the traceback)."""
    for line in text.splitlines():
        if line.startswith(">"):
            return line[1:].strip()
    return None


def problem_statement(
    targets: Sequence[str],
    failures: Mapping[str, str],
    *,
    shown: int = SHOWN_FAILURES,
) -> str:
    """A bug report written from the failing tests: each of the first ``shown`` failing
    tests with its failing line, what it reported and the innermost frame in the
    repository's code; the others by name."""
    blocks = []
    listed = [t for t in targets if t in failures] + [t for t in targets if t not in failures]
    for test in listed[:shown]:
        text = failures.get(test, "")
        block = [f"{test} fails:"]
        line = _failing_line(text)
        if line:
            block.append(f"    {line}")
        block += [f"    E   {said}" for said in _reported(text)]
        frame = innermost_frame(text)
        if frame is not None:
            where = f"{frame.path}:{frame.line}" + (
                f", in {frame.function}" if frame.function else ""
            )
            block.append(f"  raised in {where}" + (f": {frame.code}" if frame.code else ""))
        blocks.append("\n".join(block))
    rest = listed[shown:]
    if rest:
        names = ", ".join(rest[:5]) + (f" and {len(rest) - 5} more" if len(rest) > 5 else "")
        blocks.append(f"Also failing: {names}.")
    return (
        "Tests of this repository fail: the code has a bug. Find it and fix it so that the "
        "tests pass; the tests are right. Do not modify tests or test configuration: changes "
        "to them are detected and score zero.\n\n" + "\n\n".join(blocks) + "\n"
    )


#: the longest function a problem statement shows (lines); a longer one is only named
SHOWN_FUNCTION_LINES = 40
_WHERE_CALL = re.compile(r"where .*? = (?:[\w.]+\.)?(?P<name>[A-Za-z_]\w*)\(")
_CALL = re.compile(r"(?<![\w.])(?:[A-Za-z_]\w*\.)*(?P<name>[A-Za-z_]\w*)\s*\(")
_SKIP_DIRS = frozenset({".git", "__pycache__", ".venv", ".tox", "build", "dist", ".eggs"})


@dataclass(frozen=True)
class FailingCode:
    """The repository function a failure points at: where the error was raised, or the
    function the failing test line calls; its source as the work tree has it."""

    path: str
    qualname: str
    first_line: int
    last_line: int
    source: str
    raised: bool


def _code_files(workdir: Path) -> list[str]:
    found = []
    for path in sorted(workdir.rglob("*.py")):
        rel = path.relative_to(workdir).as_posix()
        if not _SKIP_DIRS.intersection(rel.split("/")) and _repository_code(rel):
            found.append(rel)
    return found


def _called_names(text: str) -> list[str]:
    """The functions a failure's report shows the test calling, most telling first: the
    ``where x = f(...)`` lines pytest adds to an assertion, then the failing line's calls."""
    names = [m["name"] for line in text.splitlines() for m in _WHERE_CALL.finditer(line)]
    line = _failing_line(text) or ""
    names += [m["name"] for m in _CALL.finditer(line)]
    skip = {"assert", "len", "list", "dict", "set", "tuple", "str", "int", "float", "bool"}
    return [n for n in dict.fromkeys(names) if n not in skip and not n.startswith("test")]


def failing_code(
    workdir: Path, targets: Sequence[str], failures: Mapping[str, str]
) -> FailingCode | None:
    """The function the first failing tests point at in the work tree (``workdir``, the
    code as the agent finds it): the innermost repository frame's function, else the one
    repository function the failing line calls (by name, defined once); None when the
    report points at none, or at one longer than :data:`SHOWN_FUNCTION_LINES`."""
    from composer_replication.envs.definitions import Definition, definitions

    sources: dict[str, list[Definition]] = {}
    texts: dict[str, str] = {}

    def defs(rel: str) -> list[Definition]:
        if rel not in sources:
            try:
                texts[rel] = (workdir / rel).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                texts[rel] = ""
            sources[rel] = definitions(texts[rel])
        return sources[rel]

    def shown(rel: str, d: Definition, raised: bool) -> FailingCode | None:
        if d.last_line - d.first_line + 1 > SHOWN_FUNCTION_LINES:
            return None
        lines = texts[rel].splitlines()[d.first_line - 1 : d.last_line]
        return FailingCode(rel, d.qualname, d.first_line, d.last_line, "\n".join(lines), raised)

    ordered = [t for t in targets if t in failures][:SHOWN_FAILURES]
    for test in ordered:
        frame = innermost_frame(failures[test])
        if frame is None or not (workdir / frame.path).is_file():
            continue
        holding = [d for d in defs(frame.path) if d.first_line <= frame.line <= d.last_line]
        if holding:
            return shown(frame.path, max(holding, key=lambda d: d.first_line), True)
    names = [n for test in ordered for n in _called_names(failures[test])]
    if not names:
        return None
    files = _code_files(workdir)
    for name in dict.fromkeys(names):
        found = [(rel, d) for rel in files for d in defs(rel) if d.name == name]
        if len(found) == 1:
            return shown(*found[0], False)
    return None


def _code_section(code: FailingCode) -> str:
    how = "The error was raised in" if code.raised else "The failing tests call"
    return (
        f"{how} `{code.qualname}` ({code.path}, lines {code.first_line}-{code.last_line}):\n\n"
        f"```python\n{code.source}\n```\n"
    )


def bug_prompt(
    workdir: Path, modification: Modification, targets: Sequence[str], failures: Mapping[str, str]
) -> str:
    """The task of a bug candidate: the problem statement of its failing tests and the code
    they point at in ``workdir`` (:func:`failing_code`), as a bug report with a traceback
    shows it; never the patch (the modification is not read)."""
    del modification  # the statement comes from the tests and the code they point at
    statement = problem_statement(targets, failures)
    code = failing_code(workdir, targets, failures)
    return statement if code is None else f"{statement}\n{_code_section(code)}"
