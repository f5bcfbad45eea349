"""How a repository's tests are run, as the repository configures it.

`discover_tests(repo)` returns the pytest command that runs the repository's own suite in a
sandbox, and the test modules that command collects (FeatureDeletion protects them against
modification). The command is always ``python -m pytest -q ...``: pytest runs
``unittest.TestCase`` suites too, and the sandbox reads per-test outcomes from pytest's junit
report.

How it decides, in pytest's own order:
- A pytest configuration at the repository root (``pytest.toml``, ``.pytest.toml``,
  ``pytest.ini``, ``.pytest.ini``, ``[tool.pytest]``/``[tool.pytest.ini_options]`` in
  ``pyproject.toml``, ``[pytest]`` in ``tox.ini``, ``[tool:pytest]`` in ``setup.cfg``; the
  first found wins, as in pytest): the command is bare (``python -m pytest -q``) and the
  configuration decides what is collected. ``testpaths`` (globs included), ``python_files``,
  ``norecursedirs`` and ``--ignore`` in ``addopts`` are read to list the collected modules.
- No configuration: pytest's default pattern (``test_*.py``, ``*_test.py``) plus the modules
  that ``python -m unittest`` discovers (``test*.py``, which includes ``tests.py``) and that
  define ``TestCase`` subclasses. When a bare pytest run would collect exactly those modules
  the command is bare; otherwise it names them (directories where pytest's walk of the
  directory finds exactly our modules, files elsewhere), so e.g. a unittest ``tests.py`` runs
  as ``python -m pytest -q tests.py`` (an explicit file is collected whatever
  ``python_files`` says).
- Code in a ``src/`` layout: ``-o pythonpath=src`` (pytest >= 7) unless the configuration
  sets ``pythonpath``, so tests import the workdir's code rather than an installed copy.

Directories never searched: hidden ones, ``.git``, ``.tox``, ``.venv``/``venv`` (and any
directory holding a ``pyvenv.cfg``), ``build``, ``dist``, ``node_modules``, ``site-packages``,
``*.egg-info``/``*.egg``, ``docs``/``doc``, ``__pycache__``. What is not read: ``tox.ini`` or
makefile commands (they are hints at most, never executed), ``collect_ignore`` in
``conftest.py``, and positional paths in ``addopts``.
"""

from __future__ import annotations

import ast
import configparser
import fnmatch
import glob
import os
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from composer_replication.common.python_source import parse_python

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 needs the tomli backport
    import tomli as tomllib

__all__ = [
    "DEFAULT_PYTHON_FILES",
    "UNITTEST_PATTERN",
    "DiscoveredTests",
    "discover_tests",
]

#: pytest's default ``python_files``.
DEFAULT_PYTHON_FILES: tuple[str, ...] = ("test_*.py", "*_test.py")
#: ``python -m unittest``'s default discovery pattern.
UNITTEST_PATTERN = "test*.py"
# pytest's default ``norecursedirs`` (hidden directories are in it as ".*").
_PYTEST_NORECURSE = (
    "*.egg",
    ".*",
    "_darcs",
    "build",
    "CVS",
    "dist",
    "node_modules",
    "venv",
    "{arch}",
)
_SKIP_DIRS = frozenset(
    {"build", "dist", "node_modules", "site-packages", "venv", "docs", "doc", "__pycache__"}
)


@dataclass(frozen=True)
class DiscoveredTests:
    """How a repository's tests run.

    Attributes:
        command: The pytest command for the sandbox, run in the repository root.
        framework: "unittest" when the test modules define ``TestCase`` subclasses, none
            imports pytest and no pytest configuration exists; else "pytest" (informational).
        test_files: Repo-relative POSIX paths of the test modules the command collects, sorted.
        source: One line saying how this was found.
        config_file: The pytest configuration file (repo-relative), None without one.
        conftest_files: The ``conftest.py`` files in the searched directories, sorted (pytest
            loads them; they deserve the same protection as the test modules).
    """

    command: str
    framework: str
    test_files: tuple[str, ...]
    source: str
    config_file: str | None = None
    conftest_files: tuple[str, ...] = ()


@dataclass(frozen=True)
class _PytestConfig:
    """A pytest configuration found at the repository root."""

    file: str
    section: str
    options: dict[str, object]

    def values(self, key: str) -> list[str] | None:
        """A list-valued option (``testpaths``, ``python_files``, ...); None when unset."""
        value = self.options.get(key)
        if value is None:
            return None
        if isinstance(value, str):
            return value.split()
        if isinstance(value, list | tuple):
            return [str(v) for v in value]
        return [str(value)]


def _ini_section(path: Path, section: str) -> dict[str, object] | None:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        parser.read(path, encoding="utf-8")
    except (configparser.Error, UnicodeDecodeError) as exc:
        raise ValueError(
            f"cannot parse {str(path)!r} ({exc}); fix the file so pytest can read it"
        ) from exc
    if not parser.has_section(section):
        return None
    return dict(parser.items(section))


def _toml(path: Path) -> dict[str, object]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"cannot parse {str(path)!r} ({exc}); fix the file so pytest can read it"
        ) from exc


def _pyproject_pytest(path: Path) -> tuple[str, dict[str, object]] | None:
    tool = _toml(path).get("tool")
    table = tool.get("pytest") if isinstance(tool, dict) else None
    if not isinstance(table, dict):
        return None
    native = {k: v for k, v in table.items() if k != "ini_options"}
    if native:
        return "[tool.pytest]", native
    if isinstance(table.get("ini_options"), dict):
        return "[tool.pytest.ini_options]", dict(table["ini_options"])
    return None


def _find_pytest_config(repo: Path) -> _PytestConfig | None:
    """The pytest configuration at ``repo``'s root, found in pytest's precedence order."""
    for name in ("pytest.toml", ".pytest.toml"):
        if (repo / name).is_file():
            table = _toml(repo / name).get("pytest")
            return _PytestConfig(name, "[pytest]", dict(table) if isinstance(table, dict) else {})
    for name in ("pytest.ini", ".pytest.ini"):
        if (repo / name).is_file():  # always the configuration, even without [pytest]
            return _PytestConfig(name, "[pytest]", _ini_section(repo / name, "pytest") or {})
    if (repo / "pyproject.toml").is_file():
        found = _pyproject_pytest(repo / "pyproject.toml")
        if found is not None:
            return _PytestConfig("pyproject.toml", *found)
    for name, section in (("tox.ini", "pytest"), ("setup.cfg", "tool:pytest")):
        if (repo / name).is_file():
            options = _ini_section(repo / name, section)
            if options is not None:
                return _PytestConfig(name, f"[{section}]", options)
    return None


def _skipped(path: Path) -> bool:
    """Directories we never search."""
    name = path.name
    return (
        name.startswith(".")
        or name in _SKIP_DIRS
        or name.endswith((".egg-info", ".egg"))
        or (path / "pyvenv.cfg").is_file()
    )


def _pytest_skips(path: Path) -> bool:
    """Directories a bare pytest run does not enter (default ``norecursedirs``, venvs)."""
    return (
        any(fnmatch.fnmatch(path.name, p) for p in _PYTEST_NORECURSE)
        or path.name == "__pycache__"
        or (path / "pyvenv.cfg").is_file()
    )


def _walk(start: Path, prune: Callable[[Path], bool] = _skipped) -> Iterator[Path]:
    """Every ``.py`` file under ``start`` (or ``start`` itself when it is a file), not
    entering directories that ``prune`` names or symlinked ones."""
    if start.is_file():
        if start.suffix == ".py":
            yield start
        return
    for dirpath, dirnames, filenames in os.walk(start):
        here = Path(dirpath)
        dirnames[:] = sorted(
            d for d in dirnames if not (here / d).is_symlink() and not prune(here / d)
        )
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield here / name


def _matches(path: Path, patterns: Sequence[str]) -> bool:
    """pytest's ``fnmatch_ex``: a pattern without a separator matches the basename, a
    relative one with separators the end of the path."""
    return any(
        fnmatch.fnmatch(path.name, p)
        if "/" not in p
        else fnmatch.fnmatch(str(path), p if os.path.isabs(p) else f"*/{p}")
        for p in patterns
    )


def _rel(repo: Path, path: Path) -> str:
    return path.relative_to(repo).as_posix()


def _module_facts(path: Path) -> tuple[bool, bool]:
    """(defines a ``...TestCase`` subclass, imports pytest) for one module; False, False when
    it does not parse."""
    try:
        tree = parse_python(path.read_bytes())
    except (SyntaxError, ValueError, OSError):
        return False, False
    testcase = imports_pytest = False
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
                testcase = testcase or name.endswith("TestCase")
        elif isinstance(node, ast.Import):
            imports_pytest = imports_pytest or any(
                a.name.split(".")[0] == "pytest" for a in node.names
            )
        elif isinstance(node, ast.ImportFrom):
            imports_pytest = imports_pytest or (node.module or "").split(".")[0] == "pytest"
    return testcase, imports_pytest


def _src_layout(repo: Path) -> bool:
    src = repo / "src"
    if not src.is_dir():
        return False
    return any(
        (child.is_dir() and (child / "__init__.py").is_file()) or child.suffix == ".py"
        for child in src.iterdir()
    )


def _ignored(options: str, repo: Path) -> list[Path]:
    """Paths named by ``--ignore`` in an ``addopts`` string."""
    tokens = shlex.split(options)
    ignored = []
    for i, token in enumerate(tokens):
        if token.startswith("--ignore="):
            ignored.append(token.split("=", 1)[1])
        elif token == "--ignore" and i + 1 < len(tokens):
            ignored.append(tokens[i + 1])
    return [(repo / p).resolve() for p in ignored]


def _skipped_below(start: Path, path: Path) -> Path | None:
    """The outermost directory between ``start`` and ``path`` that we never search."""
    for parent in reversed(path.parents):
        if start in parent.parents and _skipped(parent):
            return parent
    return None


def _configured(repo: Path, config: _PytestConfig) -> tuple[list[Path], list[str], str]:
    """The modules a bare pytest run collects under ``config`` (pytest's own walk), the
    ``--ignore`` options that keep it out of directories we never search (docs, egg-info,
    ...: a bare run would enter them), and the ``source`` line."""
    testpaths = config.values("testpaths")
    patterns = config.values("python_files") or list(DEFAULT_PYTHON_FILES)
    norecurse = config.values("norecursedirs") or list(_PYTEST_NORECURSE)
    addopts = config.options.get("addopts", "")
    addopts_text = addopts if isinstance(addopts, str) else shlex.join(map(str, addopts))
    ignored = _ignored(addopts_text, repo)
    starts: list[Path] = []
    for entry in testpaths or []:
        starts += sorted(repo / p for p in glob.glob(entry, root_dir=repo, recursive=True))
    if testpaths is None or not starts:  # pytest falls back to the rootdir too
        starts = [repo]

    def prune(path: Path) -> bool:
        return (
            any(fnmatch.fnmatch(path.name, p) for p in norecurse)
            or path.name == "__pycache__"
            or (path / "pyvenv.cfg").is_file()
        )

    files: dict[Path, None] = {}
    extra_ignores: dict[Path, None] = {}
    for start in starts:
        for path in _walk(start, prune):
            explicit = path == start  # a file named in testpaths is collected as it is
            if any(path == p or p in path.parents for p in ignored):
                continue
            if explicit or _matches(path, patterns):
                skipped = _skipped_below(start, path)
                if skipped is None:
                    files[path] = None
                else:
                    extra_ignores[skipped] = None
    detail = []
    if testpaths is not None:
        detail.append(f"testpaths = {testpaths!r}")
    if config.options.get("python_files") is not None:
        detail.append(f"python_files = {patterns!r}")
    if not detail:
        detail.append("no testpaths: collects from the repository root")
    options = [f"--ignore={_rel(repo, d)}" for d in sorted(extra_ignores)]
    return list(files), options, f"{config.file} {config.section} {', '.join(detail)}"


def _explicit_targets(repo: Path, files: Sequence[Path]) -> list[str]:
    """The fewest command-line paths that make pytest collect exactly ``files``."""
    wanted = set(files)
    targets: list[str] = []
    tops = sorted({Path(_rel(repo, f)).parts[0] for f in files})
    for top in tops:
        path = repo / top
        if path.is_file():
            targets.append(top)
            continue
        mine = {f for f in wanted if path in f.parents}
        walked = {f for f in _walk(path, _pytest_skips) if _matches(f, DEFAULT_PYTHON_FILES)}
        if walked and walked <= mine:
            targets.append(top)
            mine -= walked
        targets += sorted(_rel(repo, f) for f in mine)
    return targets


def _unconfigured(repo: Path) -> tuple[list[Path], str, str]:
    """(modules, source line, framework) without a pytest configuration: pytest's default
    pattern plus unittest-pattern modules that hold ``TestCase`` subclasses."""
    facts: dict[Path, tuple[bool, bool]] = {}
    for path in _walk(repo):
        if _matches(path, DEFAULT_PYTHON_FILES):
            facts[path] = _module_facts(path)
        elif fnmatch.fnmatch(path.name, UNITTEST_PATTERN) and path.stem.isidentifier():
            found = _module_facts(path)
            if found[0]:  # unittest's pattern, but only modules that hold TestCases
                facts[path] = found
    unittest_only = [p for p in facts if not _matches(p, DEFAULT_PYTHON_FILES)]
    if unittest_only:
        names = ", ".join(_rel(repo, p) for p in unittest_only)
        source = f"unittest modules matching {UNITTEST_PATTERN}: {names}"
    else:
        source = f"pytest default discovery ({', '.join(DEFAULT_PYTHON_FILES)})"
    testcases = any(t for t, _ in facts.values())
    uses_pytest = any(p for _, p in facts.values())
    framework = "unittest" if testcases and not uses_pytest else "pytest"
    return list(facts), source, framework


def _conftests(repo: Path, files: Sequence[Path]) -> tuple[str, ...]:
    """``conftest.py`` files pytest loads for ``files``: in the root and in every directory
    between it and a test module."""
    dirs = {repo}
    for path in files:
        dirs.update(d for d in path.parents if repo in d.parents)
    found = (d / "conftest.py" for d in dirs)
    return tuple(sorted(_rel(repo, f) for f in found if f.is_file()))


def discover_tests(repo: str | os.PathLike[str]) -> DiscoveredTests:
    """How ``repo``'s tests are run (see the module docstring for the rules).

    Raises:
        ValueError: ``repo`` is not a directory, a configuration file does not parse, or no
            test module is found.
    """
    root = Path(repo).resolve()
    if not root.is_dir():
        raise ValueError(f"repository {str(repo)!r} is not a directory; pass the repository root")
    config = _find_pytest_config(root)
    framework = "pytest"
    targets: list[str] = []
    options: list[str] = []
    if config is not None:
        files, options, source = _configured(root, config)
    else:
        files, source, framework = _unconfigured(root)
        bare = [p for p in _walk(root, _pytest_skips) if _matches(p, DEFAULT_PYTHON_FILES)]
        if set(bare) != set(files):
            targets = _explicit_targets(root, files)
    if not files:
        where = f"{config.file} {config.section}" if config else "default test file patterns"
        raise ValueError(
            f"no test modules found in repository {str(root)!r} (searched by {where}); "
            "add tests named test_*.py or point pytest's testpaths at them"
        )
    if _src_layout(root) and (config is None or config.options.get("pythonpath") is None):
        options = ["-o", "pythonpath=src", *options]
        source += "; src layout: -o pythonpath=src"
    return DiscoveredTests(
        command=shlex.join(["python", "-m", "pytest", "-q", *options, *targets]),
        framework=framework,
        test_files=tuple(sorted(_rel(root, f) for f in files)),
        source=source,
        config_file=config.file if config else None,
        conftest_files=_conftests(root, files),
    )
