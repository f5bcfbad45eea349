"""Where a repository declares what its tests need, read without running anything.

A repository's maintainers install more than its runtime dependencies before they run its
tests, and they write that down in one of several places. :func:`plan_dependencies` reads
all of them and returns a :class:`DependencyPlan` (what to ask pip for, and one line per
place it came from):

- the project's extras named for tests (``test``, ``tests``, ``testing``; ``dev`` when none
  of those exists), an extra that names the project itself (``test = ["proj[fast]"]``)
  expanded in place;
- PEP 735 ``[dependency-groups]`` of the same names (``include-group`` expanded);
- requirement files named for tests: ``requirements-test*.txt``, ``test-requirements.txt``
  and the like at the root, ``requirements/*test*.txt``, ``test*/requirements*.txt``
  (plain ``requirements.txt`` too when the repository declares no package at all);
- tox: the ``[testenv]`` ``deps`` (requirement strings and ``-r`` files), ``extras`` and
  ``dependency_groups`` of ``tox.ini``, ``tox.toml``'s ``[env_run_base]`` or
  ``pyproject.toml``'s ``[tool.tox]`` (a ``legacy_tox_ini`` string too). Lines that depend
  on a factor count when the factor names tests (``tests: hypothesis``); lines holding a
  substitution tox alone can expand (``{env:X}``) are left out.

The project's own static dependencies (PEP 621 ``[project] dependencies`` that are not
``dynamic``) are recorded too: they are what to install when its build backend cannot
report them.
"""

from __future__ import annotations

import configparser
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 needs the tomli backport
    import tomli as tomllib

__all__ = [
    "TEST_EXTRAS",
    "DependencyPlan",
    "canonical_name",
    "installable",
    "pick_extra",
    "plan_dependencies",
    "requirement_name",
]

#: extras and dependency groups that hold what tests need, in the order they are preferred
TEST_EXTRAS: tuple[str, ...] = ("test", "tests", "testing")
#: what a repository without any of those uses for development, tests included
DEV_EXTRA = "dev"
_TEST_FACTORS = frozenset({"test", "tests", "testing", "unit", "pytest"})
_REQ_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")
_TOX_ROOT = re.compile(r"\{(?:toxinidir|tox_root)\}/?")


def canonical_name(name: str) -> str:
    """A distribution name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> tuple[str, list[str]]:
    """(canonical name, extras) of a PEP 508 requirement string.

    Raises:
        ValueError: ``spec`` does not start with a distribution name.
    """
    match = _REQ_NAME.match(spec)
    if match is None:
        raise ValueError(f"not a requirement: {spec!r}")
    extras = [e.strip() for e in (match.group(2) or "").split(",") if e.strip()]
    return canonical_name(match.group(1)), extras


@dataclass(frozen=True)
class DependencyPlan:
    """What a repository's tests need, as declared.

    Attributes:
        project: The project's canonical name where static metadata gives it.
        installable: The repository declares a package its build backend can build.
        static_dependencies: The project's runtime dependencies, with those of ``extras``,
            where its metadata declares them statically (None: only its backend knows).
        extras: The project's extras to install with it (for tests).
        groups: The dependency groups whose requirements are in ``requirements``.
        requirements: Requirement strings from dependency groups and tox ``deps``.
        files: Requirement files (``pip install -r``).
        sources: One line per place something came from, e.g. ``"tox.ini [testenv] deps"``.
    """

    project: str | None
    installable: bool
    static_dependencies: tuple[str, ...] | None
    extras: tuple[str, ...]
    groups: tuple[str, ...]
    requirements: tuple[str, ...]
    files: tuple[Path, ...]
    sources: tuple[str, ...]

    @property
    def declares_anything(self) -> bool:
        """Whether the repository declares a package or anything its tests need."""
        return bool(self.installable or self.static_dependencies or self.requirements or self.files)


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot parse {str(path)!r} ({exc}); fix the file") from exc


def installable(repo: Path, pyproject: dict[str, Any] | None = None) -> bool:
    """Whether ``repo`` declares a package (not just tool settings in pyproject.toml or
    setup.cfg)."""
    data = _read_toml(repo / "pyproject.toml") if pyproject is None else pyproject
    if (repo / "setup.py").is_file() or {"project", "build-system"} & set(data):
        return True
    setup_cfg = repo / "setup.cfg"
    if not setup_cfg.is_file():
        return False
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        parser.read(setup_cfg, encoding="utf-8")
    except (configparser.Error, UnicodeDecodeError):
        return True  # let the build backend say what is wrong with it
    return parser.has_section("metadata") or parser.has_section("options")


def pick_extra(defined: Iterable[str], names: Sequence[str] = TEST_EXTRAS) -> str | None:
    """The extra or group tests use among ``defined``: the first of ``names``, else ``dev``;
    spelled as ``defined`` spells it."""
    by_key = {canonical_name(d): d for d in defined}
    for name in (*names, DEV_EXTRA):
        if canonical_name(name) in by_key:
            return by_key[canonical_name(name)]
    return None


def _expand_extra(project: str, optional: dict[str, list[str]], extra: str) -> list[str]:
    """The requirements of ``extra``, with references to the project's own extras expanded."""
    by_key = {canonical_name(k): v for k, v in optional.items()}
    out: list[str] = []
    todo, seen = [extra], set()
    while todo:
        key = canonical_name(todo.pop())
        if key in seen:
            continue
        seen.add(key)
        for spec in by_key.get(key, []):
            name, extras = requirement_name(spec)
            if name == project:
                todo += extras
            else:
                out.append(spec)
    return out


def _dependency_group(groups: dict[str, Any], name: str) -> list[str]:
    """A PEP 735 group's requirement strings, ``include-group`` entries expanded."""
    by_key = {canonical_name(k): v for k, v in groups.items()}
    out: list[str] = []
    todo, seen = [name], set()
    while todo:
        key = canonical_name(todo.pop())
        if key in seen:
            continue
        seen.add(key)
        for entry in by_key.get(key, []):
            if isinstance(entry, str):
                out.append(entry)
            elif isinstance(entry, dict) and "include-group" in entry:
                todo.append(str(entry["include-group"]))
    return out


def _requirement_files(repo: Path, has_package: bool) -> list[Path]:
    """Requirement files named for tests (plain ``requirements.txt`` too without a package)."""
    found = [p for p in sorted(repo.glob("*.txt")) if _test_named(p.name) and "req" in p.name]
    found += [p for p in sorted(repo.glob("requirements/*.txt")) if _test_named(p.name)]
    for folder in ("tests", "test", "testing"):
        found += sorted((repo / folder).glob("requirements*.txt"))
    if not has_package and (repo / "requirements.txt").is_file():
        found.insert(0, repo / "requirements.txt")
    return [p for p in dict.fromkeys(found) if p.is_file()]


def _test_named(name: str) -> bool:
    return "test" in name.lower()


@dataclass(frozen=True)
class _ToxEnv:
    """What tox's base test environment installs."""

    source: str
    deps: tuple[str, ...]
    extras: tuple[str, ...]
    groups: tuple[str, ...]


def _factor_lines(values: Iterable[str]) -> list[str]:
    """Lines of a tox setting that apply to a test run: unconditional ones, and those whose
    factors name tests (``tests: hypothesis``; ``!py38: x`` and ``py38: x`` do not)."""
    out = []
    for raw in values:
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        conditional = re.match(r"^([A-Za-z0-9_.,!{}-]+):\s+(.*)$", line)
        if conditional is not None and not line.startswith(("-", ".")):
            factors = set(re.split(r"[,{}-]", conditional.group(1).lstrip("!")))
            if conditional.group(1).startswith("!") or not factors & _TEST_FACTORS:
                continue
            line = conditional.group(2).strip()
        out.append(line)
    return out


def _split_setting(value: object) -> list[str]:
    if isinstance(value, str):
        return value.splitlines() if "\n" in value else re.split(r"[,\s]+", value)
    if isinstance(value, list):
        return [str(v) for v in value]
    return []


def _tox_ini(text: str, source: str) -> _ToxEnv | None:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        parser.read_string(text)
    except configparser.Error:
        return None
    if not parser.has_section("testenv"):
        return None
    section = parser["testenv"]
    deps = section.get("deps", "").splitlines()
    extras = _factor_lines(_split_setting(section.get("extras", "")))
    groups = _factor_lines(_split_setting(section.get("dependency_groups", "")))
    return _ToxEnv(f"{source} [testenv]", tuple(_factor_lines(deps)), tuple(extras), tuple(groups))


def _tox_table(table: dict[str, Any], source: str) -> _ToxEnv | None:
    base = table.get("env_run_base")
    if not isinstance(base, dict):
        return None

    def values(key: str) -> tuple[str, ...]:
        return tuple(_factor_lines(str(v) for v in base.get(key, []) if isinstance(v, str)))

    return _ToxEnv(
        f"{source} [env_run_base]", values("deps"), values("extras"), values("dependency_groups")
    )


def _tox(repo: Path, pyproject: dict[str, Any]) -> _ToxEnv | None:
    """tox's base test environment, from the first configuration tox itself would read."""
    if (repo / "tox.ini").is_file():
        return _tox_ini((repo / "tox.ini").read_text(encoding="utf-8", errors="replace"), "tox.ini")
    if (repo / "tox.toml").is_file():
        return _tox_table(_read_toml(repo / "tox.toml"), "tox.toml")
    tool = pyproject.get("tool")
    tox = tool.get("tox") if isinstance(tool, dict) else None
    if isinstance(tox, dict):
        legacy = tox.get("legacy_tox_ini")
        if isinstance(legacy, str):
            return _tox_ini(legacy, "pyproject.toml [tool.tox] legacy_tox_ini")
        return _tox_table(tox, "pyproject.toml [tool.tox]")
    return None


def _tox_deps(repo: Path, deps: Sequence[str]) -> tuple[list[str], list[Path]]:
    """tox ``deps`` lines as (requirement strings, requirement files); the project itself
    (``.``, ``-e .``), constraints and lines with a substitution only tox expands are left out."""
    requirements: list[str] = []
    files: list[Path] = []
    for line in deps:
        line = _TOX_ROOT.sub("", line)
        if "{" in line or line.startswith(("-c", "--constraint", "-e", "--editable")):
            continue
        if line.startswith(("-r", "--requirement")):
            name = re.sub(r"^(-r|--requirement)[=\s]*", "", line).strip()
            path = (repo / name).resolve()
            if path.is_file() and repo.resolve() in path.parents:
                files.append(path)
            continue
        if line.startswith((".", "/")) or line.startswith("-"):
            continue
        try:
            requirement_name(line)
        except ValueError:
            continue
        requirements.append(line)
    return requirements, files


def plan_dependencies(repo: str | Path, names: Sequence[str] = TEST_EXTRAS) -> DependencyPlan:
    """What ``repo``'s tests need, from every place it declares it (module docstring);
    ``names``: the extras and dependency groups that hold them, preferred in order.

    Raises:
        ValueError: ``pyproject.toml`` or ``tox.toml`` does not parse.
    """
    root = Path(repo).resolve()
    data = _read_toml(root / "pyproject.toml")
    has_package = installable(root, data)
    sources: list[str] = []
    requirements: list[str] = []
    files: list[Path] = []
    tox = _tox(root, data)

    project_table = data.get("project") if isinstance(data.get("project"), dict) else {}
    name = project_table.get("name")
    project = canonical_name(name) if isinstance(name, str) else None
    optional = project_table.get("optional-dependencies")
    optional = dict(optional) if isinstance(optional, dict) else {}
    extras = [e for e in [pick_extra(optional, names)] if e is not None]
    if tox is not None:  # tox's extras are authoritative about a test run
        extras += [e for e in tox.extras if canonical_name(e) in map(canonical_name, optional)]
    extras = list(dict.fromkeys(extras))
    if extras:
        sources.append(f"extras {', '.join(extras)}")

    groups_table = data.get("dependency-groups")
    groups_table = groups_table if isinstance(groups_table, dict) else {}
    groups = [g for g in [pick_extra(groups_table, names)] if g is not None]
    if tox is not None:
        groups += [g for g in tox.groups if canonical_name(g) in map(canonical_name, groups_table)]
    groups = list(dict.fromkeys(groups))
    for group in groups:
        requirements += _dependency_group(groups_table, group)
        sources.append(f"[dependency-groups] {group}")

    named = _requirement_files(root, has_package)
    files += named
    sources += [f"{p.relative_to(root).as_posix()}" for p in named]
    if tox is not None and tox.deps:
        tox_requirements, tox_files = _tox_deps(root, tox.deps)
        requirements += tox_requirements
        files += tox_files
        if tox_requirements or tox_files:
            sources.append(f"{tox.source} deps")

    static: tuple[str, ...] | None = None
    dynamic = set(project_table.get("dynamic", []))
    if project is not None and not dynamic & {"dependencies", "optional-dependencies"}:
        listed = list(project_table.get("dependencies", []))
        for extra in extras:
            listed += _expand_extra(project, optional, extra)
        static = tuple(listed)
    return DependencyPlan(
        project=project,
        installable=has_package,
        static_dependencies=static,
        extras=tuple(extras),
        groups=tuple(groups),
        requirements=tuple(dict.fromkeys(requirements)),
        files=tuple(dict.fromkeys(files)),
        sources=tuple(sources),
    )
