"""FeatureDeletion building blocks: candidates found with `ast`, stubs, records, JSONL files.

A candidate is a module-level function or a method whose body can be cut out and replaced by
a one-line stub that raises; the signature, decorators and docstring stay, so the agent
sees what to rebuild. The removed lines are the reference solution: they go into a
`TaskReference` (marked hidden, written to a separate file with mode 0600), never into the
task workdir.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from composer_replication.common.python_source import parse_python
from composer_replication.safety.hack_monitor import is_protected
from composer_replication.safety.holdout import DEFAULT_SPLIT, HeldoutSplit

__all__ = [
    "Candidate",
    "FDTask",
    "TaskReference",
    "apply_reference",
    "delete_body",
    "find_candidates",
    "make_stub",
    "make_task_id",
    "output_paths",
    "read_jsonl_records",
    "slug",
    "source_files",
    "unparsable_files",
    "write_heldout_tasks",
    "write_references",
    "write_tasks",
]

# Built at runtime so the package source never contains a placeholder-raise statement.
STUB_EXCEPTION = "NotImplemented" + "Error"
_SKIP_DIRS = frozenset(
    {"build", "dist", "site-packages", "node_modules", "venv", "env", "__pycache__"}
)


@dataclass(frozen=True)
class Candidate:
    """A deletable body. Lines are 1-based and inclusive."""

    file: str
    qualname: str
    body_start: int
    body_end: int
    indent: str
    header_start: int = 0  # first decorator or `def` line

    @property
    def name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class FDTask:
    """One FeatureDeletion task as the agent-facing pipeline sees it (no solution inside).

    Attributes:
        task_id: Stable id `fd:<repo>:<file>:<qualname>` (what `HeldoutSplit` hashes).
        repo: Repository name.
        file: Workdir-relative path of the edited file.
        qualname: Qualified name of the deleted function or method.
        target_tests: Tests that pass on the original and fail after the deletion.
        passing_tests: Every test passing on the original (they must stay green).
        prompt: The instruction shown to the agent.
        files: Workdir-relative files of the task workdir.
        workdir: Absolute path of the materialised task workdir.
        test_command: How to run the suite inside the sandbox.
        split: "train" or "heldout".
        test_files: The repository's test modules as discovered (protected from the agent
            beside the usual test and configuration files).
        python: The interpreter of the repository's own virtualenv (its declared
            dependencies), or None for the sandbox's default; ``python_root`` is that
            virtualenv's folder (made visible, read-only, inside the sandbox).
        image: The container image the task's tests run in (``sandbox = "docker"``), or
            None for the environment's configured one.
        reference_cost: What the scripted reference agent needed when the task was
            accepted (``turns``, ``max_reply_tokens``, ``total_tokens``) and with what
            (``tool_format``, ``tokenizer``, ``tools``); a run checks its budgets against it.
        kind: "feature_deletion" (a deleted body), "bug" (an injected bug) or "swe" (an
            imported issue).
        graded_tests: The tests the final grading runs (empty: the whole suite); every
            target and passing test must be among them.
        bug_kind: What an injected bug is (``datagen.bug_kinds``: "flip_operator", ...;
            two combined as "a+b"); None for other kinds.

    ``target_tests`` are the task's FAIL_TO_PASS tests and ``passing_tests`` minus them its
    PASS_TO_PASS tests (SWE-bench's names, arXiv 2310.06770): the task file carries both
    lists under those names too (``to_json``), for tools that read SWE-style instances.
    """

    task_id: str
    repo: str
    file: str
    qualname: str
    target_tests: tuple[str, ...]
    passing_tests: tuple[str, ...]
    prompt: str
    files: tuple[str, ...]
    workdir: str
    test_command: str
    split: str = "train"
    test_files: tuple[str, ...] = ()
    python: str | None = None
    python_root: str | None = None
    image: str | None = None
    reference_cost: dict[str, Any] | None = None
    kind: str = "feature_deletion"
    graded_tests: tuple[str, ...] = ()
    bug_kind: str | None = None

    @property
    def fail_to_pass(self) -> tuple[str, ...]:
        """Tests that fail before the fix and must pass after it."""
        return self.target_tests

    @property
    def pass_to_pass(self) -> tuple[str, ...]:
        """Tests that pass before the fix and must still pass after it."""
        targets = set(self.target_tests)
        return tuple(t for t in self.passing_tests if t not in targets)

    def to_json(self) -> dict[str, Any]:
        lists = {key: list(getattr(self, key)) for key in _TUPLE_FIELDS}
        derived = {"FAIL_TO_PASS": list(self.fail_to_pass), "PASS_TO_PASS": list(self.pass_to_pass)}
        return asdict(self) | lists | derived

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FDTask:
        fields = {k: v for k, v in data.items() if k not in _DERIVED_FIELDS}
        for key in _TUPLE_FIELDS:
            if key in fields:
                fields[key] = tuple(fields[key])
        return cls(**fields)

    def sandbox_options(self) -> dict[str, Any]:
        """Keyword arguments a sandbox factory takes for this task's own environment (its
        interpreter, or its image); empty when it has none."""
        if self.image:
            return {"image": self.image}
        if self.python:
            return {"python": self.python, "ro_binds": [self.python_root or self.python]}
        return {}


_TUPLE_FIELDS = ("target_tests", "passing_tests", "files", "test_files", "graded_tests")
# written for SWE-style readers, read back from target_tests and passing_tests
_DERIVED_FIELDS = frozenset({"FAIL_TO_PASS", "PASS_TO_PASS"})


@dataclass(frozen=True)
class TaskReference:
    """The hidden solution of a task: `body` replaces the stub line(s) `start..end` of `file`
    (a FeatureDeletion task), or `files` gives the text of every file the gold patch changes
    (an imported task; ``None`` for a file it deletes)."""

    task_id: str
    file: str
    start_line: int
    end_line: int
    stub: str
    body: str
    hidden: bool = True
    files: dict[str, str | None] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TaskReference:
        return cls(**data)

    def solved_files(self, workdir: str | os.PathLike[str]) -> dict[str, str | None]:
        """Each file the solution changes -> its solved text (None: the file goes), read
        against the task's untouched ``workdir``."""
        if self.files is not None:
            return dict(self.files)
        path = Path(workdir) / self.file
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        current = "".join(lines[self.start_line - 1 : self.end_line])
        if current != self.stub:
            raise ValueError(
                f"{self.file} lines {self.start_line}-{self.end_line} are {current!r}, not the "
                f"task stub {self.stub!r}; restore onto an untouched task workdir"
            )
        lines[self.start_line - 1 : self.end_line] = [self.body]
        return {self.file: "".join(lines)}


def make_task_id(repo: str, file: str, qualname: str) -> str:
    return f"fd:{repo}:{file}:{qualname}"


def source_files(root: Path) -> Iterator[Path]:
    """The Python files of a repository a task may change, in a stable order: hidden,
    build, environment and cache folders and ``*.egg-info`` skipped, links not followed."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d
            for d in dirnames
            if not d.startswith(".") and d not in _SKIP_DIRS and not d.endswith(".egg-info")
        )
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if name.endswith(".py") and not path.is_symlink() and path.is_file():
                yield path


def unparsable_files(
    root: str | os.PathLike[str], *, exclude: Collection[str] = ()
) -> dict[str, str]:
    """Source files (not tests, not ``exclude``) that do not parse: path -> the error, for
    saying why a repository gives fewer candidates than it has functions."""
    found = {}
    for path in source_files(Path(root)):
        rel = path.relative_to(root).as_posix()
        if is_protected(rel) or rel in exclude:
            continue
        try:
            parse_python(path.read_bytes())
        except SyntaxError as exc:
            found[rel] = f"line {exc.lineno}: {exc.msg}"
        except ValueError as exc:  # a NUL byte
            found[rel] = str(exc)
    return found


def _is_stub(body: Sequence[ast.stmt]) -> bool:
    if len(body) != 1:
        return False
    stmt = body[0]
    if isinstance(stmt, ast.Pass):
        return True
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
        return stmt.value.value is Ellipsis
    if isinstance(stmt, ast.Raise) and stmt.exc is not None:
        exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
        return isinstance(exc, ast.Name) and exc.id == STUB_EXCEPTION
    return False


def _body_span(
    node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]
) -> tuple[int, int, str] | None:
    body = list(node.body)
    doc = None
    first_expr = body[0].value if body and isinstance(body[0], ast.Expr) else None
    if isinstance(first_expr, ast.Constant) and isinstance(first_expr.value, str):
        doc = body.pop(0)
    if not body or _is_stub(body) or node.end_lineno is None:
        return None
    first = body[0]
    if first.lineno <= node.lineno:  # `def f(): return 1` on one line
        return None
    indent = lines[first.lineno - 1][: first.col_offset]
    if indent.strip():
        return None
    if doc is not None:
        if doc.end_lineno is None or first.lineno <= doc.end_lineno:
            return None
        start = doc.end_lineno + 1
    else:
        start = first.lineno
        # Comments between the signature and the first statement belong to the body.
        while start - 1 > node.lineno and (
            not lines[start - 2].strip() or lines[start - 2].lstrip().startswith("#")
        ):
            start -= 1
    return start, node.end_lineno, indent


def find_candidates(
    root: str | os.PathLike[str], *, exclude: Collection[str] = ()
) -> list[Candidate]:
    """Module-level functions and methods of module-level classes outside test files.

    Skipped: test and configuration files (``is_protected``) and the files ``exclude`` names
    (root-relative: a repository's own test modules), dunder methods, bodies that already
    are stubs (pass, ..., a raise of the stub exception), one-line definitions, files that
    do not parse.
    """
    root = Path(root)
    excluded = set(exclude)
    found: list[Candidate] = []
    for path in source_files(root):
        rel = path.relative_to(root).as_posix()
        if is_protected(rel) or rel in excluded:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = parse_python(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        pending: list[tuple[str, ast.AST]] = [("", n) for n in tree.body]
        while pending:
            prefix, node = pending.pop(0)
            if isinstance(node, ast.ClassDef):
                pending.extend((f"{prefix}{node.name}.", n) for n in node.body)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.name.startswith("__") and node.name.endswith("__"):
                    continue
                span = _body_span(node, lines)
                if span is not None:
                    header = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    found.append(Candidate(rel, prefix + node.name, *span, header_start=header))
    return found


def delete_body(text: str, candidate: Candidate) -> tuple[str, TaskReference]:
    """``text`` (the candidate's file) with its body replaced by a raising stub, and the
    reference that puts it back."""
    lines = text.splitlines(keepends=True)
    body = "".join(lines[candidate.body_start - 1 : candidate.body_end])
    message = f"{candidate.qualname} was removed; restore it"
    stub = f"{candidate.indent}raise {STUB_EXCEPTION}({message!r})\n"
    lines[candidate.body_start - 1 : candidate.body_end] = [stub]
    reference = TaskReference(
        task_id="",
        file=candidate.file,
        start_line=candidate.body_start,
        end_line=candidate.body_start,
        stub=stub,
        body=body if body.endswith("\n") else body + "\n",
    )
    return "".join(lines), reference


def make_stub(root: Path, candidate: Candidate) -> TaskReference:
    """Replace the candidate's body in `root` by a raising stub; return the reference."""
    path = root / candidate.file
    text, reference = delete_body(path.read_text(encoding="utf-8"), candidate)
    path.write_text(text, encoding="utf-8")
    return reference


def apply_reference(workdir: str | os.PathLike[str], reference: TaskReference) -> None:
    """Write the reference solution into ``workdir`` (the solution a perfect agent writes)."""
    for rel, text in reference.solved_files(workdir).items():
        path = Path(workdir) / rel
        if text is None:
            path.unlink(missing_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")


def _write_jsonl(path: Path, rows: Iterable[dict[str, Any]], mode: int | None) -> None:
    """Atomic (a crash leaves the old file, no stray temporary), a regular file only;
    ``mode`` None keeps an existing file's mode."""
    from composer_replication.common.atomic_io import write_lines_atomic

    write_lines_atomic(path, (json.dumps(row, sort_keys=True) + "\n" for row in rows), mode=mode)


def write_tasks(
    path: str | os.PathLike[str],
    tasks: Sequence[FDTask],
    *,
    split: HeldoutSplit | None = DEFAULT_SPLIT,
) -> None:
    """Write a training task file; a held-out id raises `HeldoutLeakError`.

    The project's split is in force unless another is given; ``split=None`` writes tasks
    of a pool that has no held-out part.
    """
    if split is not None:
        split.check_trainable([t.task_id for t in tasks])
    _write_jsonl(Path(path), (t.to_json() for t in tasks), None)


def split_record_path(output: str | os.PathLike[str]) -> Path:
    """Where the split a task file was made with is recorded: ``<stem>.split.json``."""
    out = Path(output)
    stem = out.name[: -len(".jsonl")] if out.name.endswith(".jsonl") else out.name
    return out.with_name(f"{stem}.split.json")


def write_split_record(output: str | os.PathLike[str], split: HeldoutSplit) -> Path:
    """Record (atomically) the split the tasks of ``output`` were made with."""
    from composer_replication.common.atomic_io import write_text_atomic

    path = split_record_path(output)
    return write_text_atomic(path, json.dumps(split.to_record(), sort_keys=True) + "\n")


def read_split_record(output: str | os.PathLike[str]) -> HeldoutSplit | None:
    """The split recorded for the tasks of ``output``; None when none was recorded
    (tasks made without a split, or by an older version)."""
    path = split_record_path(output)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc}); regenerate the tasks") from exc
    return HeldoutSplit.from_record(record, str(path))


def write_heldout_tasks(path: str | os.PathLike[str], tasks: Sequence[FDTask]) -> None:
    """Write an evaluation-only task file (every record has split "heldout")."""
    wrong = [t.task_id for t in tasks if t.split != "heldout"]
    if wrong:
        raise ValueError(f"held-out task file got tasks not marked heldout: {wrong!r}")
    _write_jsonl(Path(path), (t.to_json() for t in tasks), None)


def write_references(path: str | os.PathLike[str], refs: Sequence[TaskReference]) -> None:
    """Write the hidden references, readable by the owner only (not the sandbox uid)."""
    _write_jsonl(Path(path), (r.to_json() for r in refs), 0o600)


def read_jsonl_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rows of a JSONL file (blank lines skipped)."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def slug(task_id: str) -> str:
    """A file-system-safe directory name for a task id."""
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "-", task_id).strip("-")[:80]
    return f"{readable}-{hashlib.sha256(task_id.encode()).hexdigest()[:8]}"


def output_paths(output: Path) -> tuple[Path, Path, Path]:
    """(held-out file, reference file, workdirs dir) that belong to the training `output`."""
    stem = output.name[: -len(".jsonl")] if output.name.endswith(".jsonl") else output.name
    return (
        output.with_name(f"{stem}.heldout.jsonl"),
        output.with_name(f"{stem}.reference.jsonl"),
        output.with_name(f"{stem}.workdirs"),
    )
