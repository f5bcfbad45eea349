"""pytest inside a sandbox: a portable pytest bundle, the command line, and the junit report.

Why a bundle: the sandbox runs tests with an interpreter the unprivileged sandbox user can
read (by default `/usr/bin/python3`), which often has no pytest, and the project's own venv
may live under a directory that user cannot enter (e.g. pyenv under `/root`). Installing
into the system interpreter at runtime is not an option, so `pytest_bundle_dir()` copies the
pure-Python distributions of pytest and its requirements (pluggy, iniconfig, packaging,
pygments, ...), resolved at runtime through `importlib.metadata` from the running
environment, into a world-readable temporary directory (once per process, removed at exit).
The sandbox puts that directory on `PYTHONPATH` read-only. The copy keeps file mtimes, so
the venv's compiled `__pycache__` files stay valid for any interpreter of the same minor
version; other versions just compile in memory.

Results come from a junit-xml file (`junit_family=xunit1`, which carries each test's file),
parsed with `xml.etree` and mapped back to pytest node ids.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib.metadata as metadata
import json
import os
import shlex
import shutil
import sys
import tempfile
import threading
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import TYPE_CHECKING

from composer_replication.sandbox.base import TestRunResult
from composer_replication.sandbox.process import exec_suffix

if TYPE_CHECKING:
    from composer_replication.sandbox.base import GuardSpec
    from composer_replication.sandbox.process import ProcessOutcome

__all__ = [
    "JUNIT_PREFIX",
    "SANDBOX_ENV",
    "SYSTEM_PYTHON",
    "WORKTREE_ENV",
    "JunitReport",
    "TestsEntry",
    "build_pytest_argv",
    "bundle_distributions",
    "entry_for_tests",
    "guard_config",
    "guard_environment",
    "guard_site_dir",
    "guarded_command",
    "interpreter_bin_dir",
    "line_trace_script",
    "parse_junit",
    "pytest_bundle_dir",
    "result_of_tests",
    "sandbox_python",
    "support_root",
    "traced_command",
]

_LOCK = threading.RLock()
_SUPPORT_ROOT: Path | None = None
# A junit file larger than this is not parsed (it is produced inside the sandbox).
_MAX_JUNIT_BYTES = 64 * 1024 * 1024
_PYTHON_NAMES = ("python", "python3")

#: The interpreter a sandbox runs tests with unless told otherwise: the system one, which the
#: sandbox's unprivileged uid can read (a pyenv or venv interpreter under /root it cannot).
SYSTEM_PYTHON = "/usr/bin/python3"

#: What every backend sets for its commands: a home in the private /tmp, no bytecode
#: written into the workdir, no pytest plugins picked up from whatever is on the path (a
#: repository's environment names its plugins with ``-p``: ``sandbox.virtualenv``), and
#: two malloc arenas: glibc reserves 64 MB of address space per thread otherwise, so a
#: suite that starts ten threads would pass an address-space limit of a gigabyte.
SANDBOX_ENV = MappingProxyType(
    {
        "HOME": "/tmp",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "MALLOC_ARENA_MAX": "2",
    }
)
#: The variable naming the work tree a repository's environment imports its code from
#: (``sandbox.worktree_install``); every backend sets it to the workdir as commands see it.
WORKTREE_ENV = "COMPOSER_REPLICATION_WORKTREE"


def bundle_distributions(root: str = "pytest") -> list[metadata.Distribution]:
    """`root` and every distribution it requires (markers evaluated here, no extras)."""
    try:
        from packaging.requirements import Requirement
    except ImportError as exc:  # packaging ships with pytest; absent means no pytest either
        raise RuntimeError(
            "the sandbox pytest bundle needs pytest installed in this environment; install "
            "the dev extra: pip install 'composer-replication[dev]'"
        ) from exc

    seen: dict[str, metadata.Distribution] = {}
    todo = [root]
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError as exc:
            if name == root:
                raise RuntimeError(
                    f"{root!r} is not installed in {sys.prefix}; install the dev extra "
                    "(pip install 'composer-replication[dev]') so the sandbox can bundle it"
                ) from exc
            continue
        seen[key] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _populate(target: Path) -> None:
    for dist in bundle_distributions():
        for rel in dist.files or []:
            if str(rel).startswith(".."):  # console scripts outside site-packages
                continue
            src = Path(str(dist.locate_file(rel)))
            if not src.is_file():
                continue
            dst = target / str(rel)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)  # keeps mtime, so cached bytecode stays valid
    # Readable by the unprivileged sandbox user whatever the source permissions were.
    for dirpath, _dirnames, filenames in os.walk(target):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)


def support_root() -> Path:
    """The per-process, world-readable directory holding the bundle and interpreter shims."""
    global _SUPPORT_ROOT
    with _LOCK:
        if _SUPPORT_ROOT is None or not _SUPPORT_ROOT.is_dir():
            root = Path(tempfile.mkdtemp(prefix="composer-replication-sandbox-support-"))
            os.chmod(root, 0o755)
            atexit.register(shutil.rmtree, root, True)
            _SUPPORT_ROOT = root
        return _SUPPORT_ROOT


def pytest_bundle_dir() -> Path:
    """A world-readable directory with pytest and its requirements, created once per process.

    It lives under `support_root()` (the system temp dir) and is removed when the process
    exits.
    """
    root = support_root()
    site = root / "site"
    with _LOCK:
        if not (site / ".complete").is_file():
            shutil.rmtree(site, ignore_errors=True)
            _populate(site)
            (site / ".complete").touch(mode=0o644)
    return site


def sandbox_python() -> str:
    """``SYSTEM_PYTHON`` where it runs, else ``python3`` on PATH, else this interpreter."""
    if os.access(SYSTEM_PYTHON, os.X_OK):
        return SYSTEM_PYTHON
    return shutil.which("python3") or sys.executable


def guard_site_dir() -> Path:
    """A world-readable directory whose ``sitecustomize.py`` is the behaviour guard.

    Put first on ``PYTHONPATH`` (with ``COMPOSER_REPLICATION_GUARD`` set), every Python
    process of the run installs the guard before anything else runs.
    """
    from composer_replication.sandbox import behaviour_guard

    target = support_root() / "guard"
    with _LOCK:
        if not (target / "sitecustomize.py").is_file():
            target.mkdir(mode=0o755, exist_ok=True)
            os.chmod(target, 0o755)
            partial = target / "sitecustomize.py.partial"
            shutil.copyfile(behaviour_guard.__file__, partial)
            os.chmod(partial, 0o644)
            os.replace(partial, target / "sitecustomize.py")
    return target


def line_trace_script() -> Path:
    """A world-readable copy of ``sandbox.line_trace`` (in ``support_root()``, which the
    sandbox binds read-only): the tracer a test command can run under."""
    from composer_replication.sandbox import line_trace

    target = support_root() / "trace" / "line_trace.py"
    with _LOCK:
        if not target.is_file():
            target.parent.mkdir(mode=0o755, exist_ok=True)
            os.chmod(target.parent, 0o755)
            partial = target.with_name("line_trace.py.partial")
            shutil.copyfile(line_trace.__file__, partial)
            os.chmod(partial, 0o644)
            os.replace(partial, target)
    return target


def traced_command(test_command: str, script: str, output: str) -> str | None:
    """``test_command`` (a pytest command) run under the line tracer ``script``, writing what
    ran to ``output``; None for a command that is not pytest."""
    tokens = shlex.split(test_command)
    if not tokens:
        return None
    if os.path.basename(tokens[0]) in ("pytest", "py.test"):
        rest = tokens[1:]
    elif _is_python_word(tokens[0]) and tokens[1:3] == ["-m", "pytest"]:
        rest = tokens[3:]
    else:
        return None
    if "pytest_cov" in _plugins(rest):
        # coverage.py installs its own trace function over the tracer's (Python < 3.12):
        # the run with the tracer measures nothing with pytest-cov on
        rest = [*rest, "--no-cov"]
    traced = [
        "python", script, ".", output, "-m", "pytest", "-p", "no:cacheprovider",
        "--continue-on-collection-errors",  # as the graded runs: one bad module stops none
        *rest,
    ]  # fmt: skip
    return shlex.join(traced)


def _plugins(args: list[str]) -> set[str]:
    """The plugins ``-p NAME`` / ``-pNAME`` arguments load."""
    names = set()
    for i, arg in enumerate(args):
        if arg == "-p" and i + 1 < len(args):
            names.add(args[i + 1])
        elif arg.startswith("-p") and len(arg) > 2 and not arg.startswith("-p="):
            names.add(arg[2:])
    return names


def guard_config(guard: GuardSpec, root: str | os.PathLike[str]) -> dict[str, str]:
    """The behaviour guard's configuration variable: what it protects under ``root`` (the
    workdir as the test run sees it) and whose code it judges."""
    from composer_replication.sandbox.behaviour_guard import GUARD_ENV

    config = {
        "root": os.fspath(root),
        "protected": list(guard.protected),
        "candidates": list(guard.candidates),
        "report_prefix": JUNIT_PREFIX,
    }
    return {GUARD_ENV: json.dumps(config)}


def guard_environment(
    guard: GuardSpec, root: str | os.PathLike[str], *, with_bundle: bool
) -> dict[str, str]:
    """The environment variables that put a test run under the behaviour guard: its
    configuration (``guard_config``), the ``PYTHONPATH`` that loads it first (then the
    pytest bundle when the run uses it) and ``PYTEST_PLUGINS``, which has pytest register
    it as a plugin before any conftest (so it records pytest's identity)."""
    from composer_replication.sandbox.behaviour_guard import GUARD_PLUGIN

    path = [str(guard_site_dir())]
    if with_bundle:
        path.append(str(pytest_bundle_dir()))
    return {
        **guard_config(guard, root),
        "PYTHONPATH": ":".join(path),
        "PYTEST_PLUGINS": GUARD_PLUGIN,
    }


def guarded_command(argv: Sequence[str], guard_dir: str) -> list[str]:
    """``argv`` behind a shell that puts ``guard_dir`` (where ``guard_site_dir()`` is
    visible to the run, e.g. bound into a container) first on ``PYTHONPATH`` and the guard
    first in ``PYTEST_PLUGINS``, keeping what the environment (an image) set there."""
    from composer_replication.sandbox.behaviour_guard import GUARD_PLUGIN

    script = (
        'export PYTHONPATH="$1${PYTHONPATH:+:$PYTHONPATH}" '
        'PYTEST_PLUGINS="$2${PYTEST_PLUGINS:+,$PYTEST_PLUGINS}"; shift 2; exec "$@"'
    )
    return ["sh", "-c", script, "sh", guard_dir, GUARD_PLUGIN, *argv]


def interpreter_bin_dir(python: str) -> Path:
    """A directory with `python`, `python3` and `pytest` commands that run `python`.

    They are scripts that exec `python` by its own path (not links to it): a virtualenv's
    interpreter finds its environment only when started by that path.
    """
    name = "bin-" + hashlib.sha256(python.encode()).hexdigest()[:12]
    bin_dir = support_root() / name
    with _LOCK:
        if not (bin_dir / "pytest").is_file():
            bin_dir.mkdir(mode=0o755, exist_ok=True)
            os.chmod(bin_dir, 0o755)
            scripts = {
                "python": f'exec {shlex.quote(python)} "$@"',
                "python3": f'exec {shlex.quote(python)} "$@"',
                "pytest": f'exec {shlex.quote(python)} -m pytest "$@"',
            }
            for command, line in scripts.items():  # pytest last: it marks the folder done
                script = bin_dir / command
                partial = bin_dir / f".{command}.partial"
                partial.write_text(f"#!/bin/sh\n{line}\n")
                os.chmod(partial, 0o755)
                os.replace(partial, script)
    return bin_dir


def _is_python_word(token: str) -> bool:
    # Bare interpreter names only; an explicit path is the caller's choice and kept.
    if "/" in token:
        return False
    return token in _PYTHON_NAMES or (
        token.startswith("python3.") and token[len("python3.") :].isdigit()
    )


def build_pytest_argv(
    test_command: str, tests: Sequence[str], *, python: str, junit_path: str
) -> tuple[list[str], bool]:
    """Turn a test command into argv; returns `(argv, is_pytest)`.

    `pytest ...`, `py.test ...` and `python -m pytest ...` run under `python` with the cache
    plugin off and a junit report written to `junit_path`. Any other command runs as given
    with `tests` appended, and its result is judged by exit code alone.
    """
    tokens = shlex.split(test_command)
    if not tokens:
        raise ValueError("test_command is empty; pass e.g. 'python -m pytest -q'")
    bad = [t for t in tests if not isinstance(t, str) or not t or t.startswith("-")]
    if bad:
        raise ValueError(
            f"test ids must be non-empty strings that do not start with '-', got {bad!r}; "
            "put options into test_command instead"
        )
    head = os.path.basename(tokens[0])
    if head in ("pytest", "py.test"):
        rest = tokens[1:]
    elif _is_python_word(tokens[0]) and tokens[1:3] == ["-m", "pytest"]:
        rest = tokens[3:]
    elif tokens[1:3] == ["-m", "pytest"]:
        return [*tokens[:3], *_report_options(junit_path), *tokens[3:], *tests], True
    else:
        if _is_python_word(tokens[0]):
            tokens[0] = python
        return [*tokens, *tests], False
    return [python, "-m", "pytest", *_report_options(junit_path), *rest, *tests], True


#: Every junit report the sandbox asks pytest for is named with this prefix.
JUNIT_PREFIX = ".cr-junit-"


def _report_options(junit_path: str) -> list[str]:
    # --color=no: a repository's addopts may ask for colour, whose escapes would reach the
    # agent's observations and datagen's reasons (the command line wins over addopts);
    # --continue-on-collection-errors: one module that fails to import (an optional
    # dependency missing) would otherwise stop every other test from running
    return [
        "-p", "no:cacheprovider", "--color=no", "--continue-on-collection-errors",
        f"--junitxml={junit_path}", "-o", "junit_family=xunit1",
    ]  # fmt: skip


#: How many failing tests a report keeps the failure text of, and how much of each.
MAX_FAILURES_KEPT = 100
MAX_FAILURE_CHARS = 4000


@dataclass(frozen=True)
class JunitReport:
    """Counts and per-test outcomes read from one junit-xml file, with what was reported of
    the first ``MAX_FAILURES_KEPT`` failures and errors (message, then traceback)."""

    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    outcomes: dict[str, str] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)


def _failure_text(case: ET.Element) -> str:
    """The message and traceback of a test case's failure or error element, capped."""
    for child in case:
        if child.tag in ("failure", "error"):
            # the body is the traceback pytest printed (with the message in its E lines)
            text = (child.text or "").strip() or (child.get("message") or "").strip()
            if len(text) > MAX_FAILURE_CHARS:  # the end holds the innermost frame
                text = "...\n" + text[-MAX_FAILURE_CHARS:]
            return text
    return ""


def _nodeid(case: ET.Element) -> str:
    file = case.get("file") or ""
    classname = case.get("classname") or ""
    name = case.get("name") or ""
    if not file:
        return f"{classname}::{name}" if classname else name
    module = file[:-3].replace("/", ".") if file.endswith(".py") else file
    if not classname and name == module:  # a collection error for the whole file
        return file
    # a text file's doctest (`--doctest-glob`): classname is its path with dots
    dotted = module if file.endswith(".py") else file.replace("/", ".")
    if classname.startswith(dotted):
        rest = classname[len(dotted) :].lstrip(".")
        return "::".join([file, *(rest.split(".") if rest else []), name])
    # A test inherited from a class in another file (a mixin in tests/__init__.py): `file`
    # is where its function is written, `classname` the module and classes that collected
    # it. The module's parts end where the first class name (capitalised) begins.
    parts = classname.split(".")
    first_class = next((i for i, p in enumerate(parts) if p[:1].isupper()), len(parts))
    if first_class == 0:
        return "::".join([file, name])
    collected = "/".join(parts[:first_class]) + ".py"
    return "::".join([collected, *parts[first_class:], name])


_SEVERITY = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


def parse_junit(path: str | os.PathLike[str]) -> JunitReport | None:
    """Read a pytest junit-xml file; None when it is missing, a symlink, huge or malformed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        if os.fstat(fh.fileno()).st_size > _MAX_JUNIT_BYTES:
            return None
        try:
            root = ET.parse(fh).getroot()
        except ET.ParseError:
            return None
    outcomes: dict[str, str] = {}
    failures: dict[str, str] = {}
    for case in root.iter("testcase"):
        tags = {child.tag for child in case}
        if "failure" in tags:
            outcome = "failed"
        elif "error" in tags:
            outcome = "error"
        elif "skipped" in tags:
            outcome = "skipped"
        else:
            outcome = "passed"
        nodeid = _nodeid(case)
        previous = outcomes.get(nodeid)
        if previous is None or _SEVERITY[outcome] > _SEVERITY[previous]:
            outcomes[nodeid] = outcome
            if outcome in ("failed", "error") and (
                nodeid in failures or len(failures) < MAX_FAILURES_KEPT
            ):
                failures[nodeid] = _failure_text(case)
    counts = {o: 0 for o in _SEVERITY}
    for outcome in outcomes.values():
        counts[outcome] += 1
    return JunitReport(
        passed=counts["passed"],
        failed=counts["failed"],
        errors=counts["error"],
        skipped=counts["skipped"],
        outcomes=outcomes,
        failures=failures,
    )


@dataclass(frozen=True)
class TestsEntry:
    """What a backend executes to run a task's tests, and where their report lands.

    Attributes:
        argv: The command inside the sandbox (interpreter, pytest options, test ids; behind
            the guard's shell where the guard is bound into the sandbox).
        env: The variables the run adds to the backend's environment (the guard's).
        report: The junit report as the host sees it; None when the command is not
            pytest (judged by its exit code alone).
        guarded: The run is under the behaviour guard.
    """

    __test__ = False  # not a pytest test class

    argv: list[str]
    env: dict[str, str]
    report: Path | None
    guarded: bool


def entry_for_tests(
    test_command: str,
    tests: Sequence[str],
    *,
    python: str,
    workdir: Path,
    inside: str | None = None,
    guard: GuardSpec | None = None,
    guard_mount: str | None = None,
    with_bundle: bool = False,
) -> TestsEntry:
    """The entry of one test run (:func:`build_pytest_argv` with a fresh report name).

    ``workdir`` is the host directory; ``inside`` the same directory as the run sees it
    (a container's bind target; default: the same path). With ``guard``, the run is under
    the behaviour guard: where the sandbox binds ``guard_site_dir()`` at ``guard_mount``
    (a container, whose image may set ``PYTHONPATH``), the command is wrapped by
    :func:`guarded_command`; otherwise the backend sets the run's environment whole and
    :func:`guard_environment` gives its variables (``with_bundle``: the pytest bundle after
    the guard on ``PYTHONPATH``).
    """
    name = f"{JUNIT_PREFIX}{uuid.uuid4().hex}.xml"
    root = inside if inside is not None else os.fspath(workdir)
    argv, is_pytest = build_pytest_argv(
        test_command, list(tests), python=python, junit_path=str(PurePosixPath(root) / name)
    )
    env: dict[str, str] = {}
    if guard is not None and guard_mount is not None:
        argv, env = guarded_command(argv, guard_mount), guard_config(guard, root)
    elif guard is not None:
        env = guard_environment(guard, root, with_bundle=with_bundle)
    report = Path(workdir) / name if is_pytest else None
    return TestsEntry(argv=argv, env=env, report=report, guarded=guard is not None)


def result_of_tests(
    entry: TestsEntry,
    outcome: ProcessOutcome,
    *,
    timeout_s: float,
    isolated: bool,
    infrastructure_error: str | None = None,
) -> TestRunResult:
    """The result of a run of ``entry``: its junit report read (and removed) where pytest
    ran, a run without a report or one stopped part-way counted as an error (fail closed),
    and the guard's flags read from the output of a guarded run."""
    from composer_replication.sandbox.behaviour_guard import parse_guard_flags

    report: JunitReport | None = None
    if entry.report is not None:
        report = parse_junit(entry.report) or JunitReport(errors=1)
        with contextlib.suppress(OSError):
            entry.report.unlink()
    if outcome.stopped:  # killed part-way: whatever report exists is not a verdict
        report = JunitReport(errors=1)
    report = report or JunitReport()
    return TestRunResult(
        passed=report.passed,
        failed=report.failed,
        errors=report.errors,
        skipped=report.skipped,
        outcomes=dict(report.outcomes),
        exit_code=outcome.exit_code,
        output=outcome.text() + exec_suffix(outcome, timeout_s),
        timed_out=outcome.timed_out,
        isolated=isolated,
        duration_s=outcome.duration_s,
        infrastructure_error=infrastructure_error,
        behaviour_flags=tuple(parse_guard_flags(outcome.text())) if entry.guarded else (),
        failures=dict(report.failures),
    )
