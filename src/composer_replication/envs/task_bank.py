"""The ``python_functions`` task bank: small, verifiable Python function tasks.

The shipped set (``envs/tasks/python_functions.jsonl``) holds 320 tasks written for this
project and sized for a very small policy (SmolLM2-135M-Instruct): half (160) are one-liners
or a short loop (``easy``), about a third (112) need a loop with a small idea (``medium``)
and the rest (48) a classic algorithm (``hard``). Each task is one JSON object per line:

    task_id      "pf-NNN-short-name", unique
    entry_point  the function the candidate must define
    signature    "def entry_point(args) -> type:"
    docstring    one to three sentences and one ``>>>`` example
    prompt       the stub shown to the model: the signature and the docstring
    reference    a reference solution (a function definition, standard library only)
    tests        3 to 6 independent pytest functions (every shipped task has 4 to 6) with
                 plain asserts; they import nothing, call the entry point by name with
                 positional plain-data arguments (see ``plain_data``) and compare plain data
    difficulty   "easy" | "medium" | "hard"
    tags         free-form labels

Grading layout (see ``task_files``): the candidate goes in ``solution.py``, the tests in
``test_solution.py`` behind ``from solution import *``; the reward is the fraction of the
task's tests that pass. ``extract_code`` turns a raw completion into that candidate (or
``None``, the format failure). ``validate_reference`` runs the tests against the task's own
reference in a plain subprocess: it is for trusted code only; candidates from a policy must
be run in the project's sandbox (``composer_replication.datagen``).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

from composer_replication.common.python_source import parse_python

__all__ = [
    "DIFFICULTIES",
    "SOLUTION_FILE",
    "TASKS_PACKAGE",
    "TASKS_RESOURCE",
    "TEST_FILE",
    "TEST_HEADER",
    "PythonTask",
    "extract_code",
    "load_tasks",
    "task_files",
    "validate_reference",
]

DIFFICULTIES = ("easy", "medium", "hard")
TASKS_PACKAGE = "composer_replication.envs.tasks"
TASKS_RESOURCE = "python_functions.jsonl"
SOLUTION_FILE = "solution.py"
TEST_FILE = "test_solution.py"
TEST_HEADER = "from solution import *\n"

_MIN_TESTS = 3
_STR_FIELDS = (
    "task_id",
    "entry_point",
    "signature",
    "docstring",
    "prompt",
    "reference",
    "tests",
    "difficulty",
)
_FIELDS = (*_STR_FIELDS, "tags")


@dataclass(frozen=True)
class PythonTask:
    """One task of the bank; the fields mirror the JSONL keys (``tags`` as a tuple)."""

    task_id: str
    entry_point: str
    signature: str
    docstring: str
    prompt: str
    reference: str
    tests: str
    difficulty: str
    tags: tuple[str, ...] = ()

    @cached_property
    def test_names(self) -> tuple[str, ...]:
        """Names of the task's test functions, in file order."""
        return _test_function_names(parse_python(self.tests))

    @property
    def n_tests(self) -> int:
        """How many tests the task has (the denominator of its partial-credit reward)."""
        return len(self.test_names)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> PythonTask:
        """Build and validate a task from one decoded JSONL object (ValueError if bad)."""
        return _task_from_raw(raw)


# ---------------------------------------------------------------------------------------
# Loading and validation


def _test_function_names(module: ast.Module) -> tuple[str, ...]:
    return tuple(
        node.name
        for node in module.body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    )


def _top_level_function(module: ast.Module, name: str) -> ast.FunctionDef | None:
    found = None
    for node in module.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            found = node
    return found


def _task_from_raw(raw: Mapping[str, Any]) -> PythonTask:
    if not isinstance(raw, Mapping):
        raise ValueError(f"expected a JSON object, got {type(raw).__name__}")
    name = raw.get("task_id")
    label = f"task {name!r}" if isinstance(name, str) and name else "task <no task_id>"

    def fail(problem: str) -> ValueError:
        return ValueError(f"{label}: {problem}")

    missing = [key for key in _FIELDS if key not in raw]
    if missing:
        raise fail(f"missing field(s) {', '.join(missing)}")
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise fail(f"unknown field(s) {', '.join(unknown)}")
    for key in _STR_FIELDS:
        if not isinstance(raw[key], str) or not raw[key].strip():
            raise fail(f"field {key!r} must be a non-empty string")
    tags = raw["tags"]
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise fail("field 'tags' must be a list of strings")
    task_id, entry = raw["task_id"], raw["entry_point"]
    if any(ch.isspace() for ch in task_id):
        raise fail("task_id contains whitespace")
    if not entry.isidentifier():
        raise fail(f"entry_point {entry!r} is not a Python identifier")
    if raw["difficulty"] not in DIFFICULTIES:
        raise fail(f"difficulty {raw['difficulty']!r} is not one of {', '.join(DIFFICULTIES)}")

    signature = raw["signature"]
    if not re.match(rf"def\s+{re.escape(entry)}\s*\(", signature) or not signature.endswith(":"):
        raise fail(f"signature {signature!r} is not 'def {entry}(...):'")
    sources = {
        "signature": signature + "\n    ...\n",
        "prompt": raw["prompt"],
        "reference": raw["reference"],
        "tests": raw["tests"],
    }
    parsed: dict[str, ast.Module] = {}
    for key, source in sources.items():
        try:
            parsed[key] = parse_python(source)
        except SyntaxError as exc:
            raise fail(f"{key} does not parse: {exc.msg} (line {exc.lineno})") from None
    if _top_level_function(parsed["prompt"], entry) is None:
        raise fail(f"prompt does not define {entry}()")
    if _top_level_function(parsed["reference"], entry) is None:
        raise fail(f"reference does not define the entry point {entry}()")
    names = _test_function_names(parsed["tests"])
    if len(names) < _MIN_TESTS:
        raise fail(f"tests define {len(names)} test_ function(s), at least {_MIN_TESTS} needed")
    if len(set(names)) != len(names):
        raise fail("tests define the same test_ function twice")
    return PythonTask(
        task_id=task_id,
        entry_point=entry,
        signature=signature,
        docstring=raw["docstring"],
        prompt=raw["prompt"],
        reference=raw["reference"],
        tests=raw["tests"],
        difficulty=raw["difficulty"],
        tags=tuple(tags),
    )


def load_tasks(path: str | os.PathLike[str] | None = None) -> list[PythonTask]:
    """Load and validate a task file (default: the shipped ``python_functions.jsonl``).

    Blank lines are skipped. Any bad line (invalid JSON, a missing or mistyped field, an
    entry point the reference does not define, tests that do not parse or have fewer than
    three ``test_`` functions, an unknown difficulty, a repeated task_id) raises
    ``ValueError`` naming the file, the line, the task and the problem.
    """
    if path is None:
        where = f"{TASKS_PACKAGE}/{TASKS_RESOURCE}"
        text = resources.files(TASKS_PACKAGE).joinpath(TASKS_RESOURCE).read_text("utf-8")
    else:
        where = str(path)
        text = Path(path).read_text(encoding="utf-8")
    tasks: list[PythonTask] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}:{lineno}: invalid JSON: {exc.msg}") from None
        try:
            task = _task_from_raw(raw)
        except ValueError as exc:
            raise ValueError(f"{where}:{lineno}: {exc}") from None
        if task.task_id in seen:
            raise ValueError(
                f"{where}:{lineno}: task {task.task_id!r}: duplicate task_id "
                f"(first defined on line {seen[task.task_id]})"
            )
        seen[task.task_id] = lineno
        tasks.append(task)
    return tasks


def task_files(task: PythonTask, candidate_source: str) -> dict[str, str]:
    """The two files a grader writes: the candidate and the task's tests importing it."""
    return {SOLUTION_FILE: candidate_source, TEST_FILE: TEST_HEADER + task.tests}


# ---------------------------------------------------------------------------------------
# Pulling the function out of a completion

_FENCE_RE = re.compile(
    r"^[ \t]*(?P<fence>`{3,}|~{3,})[^\n]*\n(?P<body>.*?)(?:^[ \t]*(?P=fence)[ \t]*$|\Z)",
    re.DOTALL | re.MULTILINE,
)


def _try_parse(source: str) -> ast.Module | None:
    # Model output often holds literals like ``1for``: the tokenizer's SyntaxWarning for
    # them would print to the run's stderr once per completion.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        try:
            return parse_python(source)
        except (SyntaxError, ValueError):  # ValueError: NUL bytes in the source
            return None


def _indent_width(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def _code_window(
    lines: list[str], start: int, parsed: dict[tuple[int, int], str | None]
) -> str | None:
    """The code around the ``def`` on ``lines[start]``, or None if that def is unusable.

    The text is cut into chunks at every non-blank line indented no deeper than the def
    (the def with its indented body is one chunk). Every chunk that parses on its own is
    kept; prose and markdown chunks are dropped. The def's own chunk must parse as it is:
    a body with a syntax error, or cut off by the token budget, is not repaired.
    ``parsed`` caches chunk results across the defs of one text.
    """
    base = _indent_width(lines[start])
    bounds = [
        i
        for i, line in enumerate(lines)
        if line.strip() and (_indent_width(line) <= base or i == start)
    ]
    pieces: list[str] = []
    for k, lo in enumerate(bounds):
        hi = bounds[k + 1] if k + 1 < len(bounds) else len(lines)
        if (lo, hi) not in parsed:
            text = textwrap.dedent("\n".join(lines[lo:hi])) + "\n"
            parsed[(lo, hi)] = text if _try_parse(text) is not None else None
        chunk = parsed[(lo, hi)]
        if lo == start and chunk is None:
            return None
        if chunk is not None:
            pieces.append(chunk)
    return "".join(pieces)


def _free_names(node: ast.AST) -> set[str]:
    """Names ``node`` reads but does not bind itself (an over-approximation of its globals).

    Locals are left out so that a usage line such as ``result = f(3)`` is not kept just
    because ``f`` has a local variable called ``result``.
    """
    loaded: set[str] = set()
    bound: set[str] = set()
    declared_global: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            (loaded if isinstance(n.ctx, ast.Load) else bound).add(n.id)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
        elif isinstance(n, ast.Global):
            declared_global.update(n.names)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n is not node:
            bound.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in n.names)
    return loaded - (bound - declared_global)


def _node_source(lines: list[str], node: ast.stmt) -> str:
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    end = node.end_lineno or node.lineno
    return "\n".join(lines[first - 1 : end]).rstrip() + "\n"


def _select(source: str, entry_point: str) -> str | None:
    """Imports + the (last) def of ``entry_point`` + the top-level defs it needs."""
    module = _try_parse(source)
    if module is None:
        return None
    defs: dict[str, ast.stmt] = {}
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        defs[name.id] = node
    entry = defs.get(entry_point)
    if not isinstance(entry, ast.FunctionDef):
        return None
    keep: set[int] = set()
    todo = [entry]
    while todo:
        node = todo.pop()
        if id(node) in keep:
            continue
        keep.add(id(node))
        todo.extend(defs[name] for name in _free_names(node) if name in defs)
    lines = source.splitlines()
    parts = [
        _node_source(lines, node)
        for node in module.body
        if isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in keep
    ]
    code = "\n".join(parts)
    return code if _try_parse(code) is not None else None


def _extract_from(text: str, entry_point: str) -> str | None:
    def_re = re.compile(rf"^[ \t]*def[ \t]+{re.escape(entry_point)}[ \t]*\(")
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if def_re.match(line)]
    if not starts:
        return None
    whole = textwrap.dedent(text)
    if _try_parse(whole) is not None:
        return _select(whole, entry_point)
    parsed: dict[tuple[int, int], str | None] = {}
    for start in reversed(starts):  # the last usable definition wins
        window = _code_window(lines, start, parsed)
        if window is not None:
            code = _select(window, entry_point)
            if code is not None:
                return code
    return None


def extract_code(completion_text: str, entry_point: str) -> str | None:
    """The candidate source in a model completion, or ``None`` (the format check failed).

    Looks in the fenced code blocks (```` ``` ```` or ``~~~``, any language tag, the last
    block with a usable definition wins; an unterminated block runs to the end of the text)
    and then in the whole text, which may be bare code surrounded by prose. From the code
    it keeps the top-level imports, the last ``def entry_point(...)`` and the top-level
    functions, classes and constants that definition uses, transitively; other statements
    (examples, prints, asserts, ``if __name__ == "__main__":`` blocks) are dropped.
    Returns ``None`` when no syntactically valid top-level ``def`` of ``entry_point`` can
    be found; a definition with a syntax error in its body, e.g. one cut off by the token
    budget, is not repaired and counts as missing. A body-only continuation of the prompt
    stub has no ``def`` line: prepend ``task.prompt`` before calling.
    """
    if not completion_text or entry_point not in completion_text:
        return None
    blocks = [m.group("body") for m in _FENCE_RE.finditer(completion_text)]
    for block in reversed(blocks):
        code = _extract_from(block, entry_point)
        if code is not None:
            return code
    return _extract_from(completion_text, entry_point)


# ---------------------------------------------------------------------------------------
# Running the tests


def _passed_tests(junit_xml: Path, names: tuple[str, ...]) -> int:
    try:
        root = ET.parse(junit_xml).getroot()
    except (OSError, ET.ParseError):
        return 0
    wanted = set(names)
    passed = set()
    for case in root.iter("testcase"):
        name = case.get("name", "")
        if name in wanted and not any(
            child.tag in ("failure", "error", "skipped") for child in case
        ):
            passed.add(name)
    return len(passed)


def validate_reference(task: PythonTask, *, timeout_s: float = 10) -> tuple[int, int]:
    """Run the task's tests against its own reference; return ``(passed, total)``.

    Runs ``sys.executable -m pytest -q`` in a fresh temporary directory (plugin
    autoloading off, no cache, its own ``pytest.ini``) and reads the junit report.
    ``total`` is the number of ``test_`` functions in the task; a timeout or a crash
    counts every test as failed. Trusted code only: this is not a sandbox.
    """
    names = task.test_names
    with tempfile.TemporaryDirectory(prefix="pf-task-") as tmp:
        root = Path(tmp)
        for filename, text in task_files(task, task.reference).items():
            (root / filename).write_text(text, encoding="utf-8")
        (root / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
        junit = root / "report.xml"
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
        env.pop("PYTEST_ADDOPTS", None)
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            TEST_FILE,
        ]
        try:
            subprocess.run(
                cmd,
                cwd=root,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return (0, len(names))
        return (_passed_tests(junit, names), len(names))
