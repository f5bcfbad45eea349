"""A virtualenv with a repository's declared dependencies, for running its tests in a sandbox.

`build_repo_environment(repo, dest_root)` makes (or reuses) a venv holding what the
repository needs to run its tests, but NOT the repository itself: the tests must import the
workdir's code, the code an agent edits. `RepoEnvironment.sandbox_kwargs()` gives the
`LocalSubprocessSandbox` arguments that run tests with that venv's interpreter.

How dependencies are resolved (pip decides, we only choose what to ask for):
- Static metadata: a ``pyproject.toml`` ``[project]`` table whose ``dependencies`` and
  ``optional-dependencies`` are not ``dynamic`` is authoritative (PEP 621: a build backend
  must not change static fields), so those requirement strings are handed to pip directly.
  No build backend runs, which also makes offline builds need only the dependencies' wheels.
  An extra that names the project itself (``test = ["proj[fast]"]``) is expanded in place.
- Anything else (setup.py, setup.cfg, dynamic dependencies): pip asks the repository's build
  backend for its metadata (``pip install --dry-run "<repo>[extra]"``, with build isolation,
  so the backend comes from the index or the wheelhouse) and resolves that.
- Both add: the first of ``extras`` the project defines, the first PEP 735
  ``[dependency-groups]`` group of those names, and requirement files named for tests
  (``requirements-test*.txt``, ``test-requirements.txt``, ``requirements/test*.txt``,
  ``tests/requirements*.txt``; plain ``requirements.txt`` only when the repository declares
  no packaging metadata at all).
- pip resolves everything once with ``--dry-run --ignore-installed --report``; we then install
  exactly the reported distributions with ``--no-deps``, leaving out the repository's own (the
  report item whose ``download_info.url`` is the repository, or whose name is the project's),
  so a dependency that depends back on the project cannot pull a released copy in either.

Where pip comes from: the venv is made with ``python -m venv --without-pip`` (tens of
milliseconds instead of seconds) and driven by this environment's pip through
``pip --python <venv python>`` (pip >= 22.3); without such a pip, the venv bootstraps its own
with ``ensurepip``.

Offline: ``wheelhouse=DIR`` runs pip with ``--no-index --find-links DIR`` and no pip
configuration or ``PIP_*`` variables from the environment, so DIR is the only source. A
repository without static ``[project]`` dependencies then needs its build backend (e.g. the
setuptools wheel, and wheel for setuptools < 70.1) in DIR as well.

Reuse: the venv lives in ``dest_root/<key>``, ``key`` a hash of the interpreter, the
dependency declaration files, ``extras`` and the wheelhouse, so all tasks of one repository
share it and a second run costs nothing. It is built in a temporary sibling and renamed into
place only when complete (a marker file is its last write), so nothing half-built is ever
reused; on failure the sibling is removed. Everything in it is world-readable (directories
0o755, files 0o644, or 0o755 with an execute bit) so the sandbox's unprivileged uid can run it.

What this does not do: run the repository's build (setup.py runs only for metadata), install
system libraries, or make test-time network access work (the sandbox has none).
"""

from __future__ import annotations

import configparser
import hashlib
import importlib.metadata
import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer_replication.atomic_io import build_dir_atomically
from composer_replication.sandbox.pytest_support import SYSTEM_PYTHON

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 needs the tomli backport
    import tomli as tomllib

__all__ = [
    "DEFAULT_PYTHON",
    "MARKER",
    "RepoEnvironment",
    "build_repo_environment",
    "declares_dependencies",
]

DEFAULT_PYTHON = SYSTEM_PYTHON
#: Written last into a complete environment; its JSON records what was installed.
MARKER = ".composer-replication-env.json"
_METADATA_FILES = ("pyproject.toml", "setup.cfg", "setup.py")
_FIX_OFFLINE = (
    "put the missing distributions in the wheelhouse (pip download -d {wheelhouse} ...; "
    "a repository without static [project] dependencies also needs its build backend there)"
)
_FIX_TIMEOUT = "pass a larger timeout_s, or a wheelhouse (nothing is downloaded then)"
_FIX_BACKEND = (
    "the repository's build backend could not report its metadata: fix its packaging files, "
    "or declare the dependencies statically in pyproject.toml [project]"
)
_FIX_VENV = "install the interpreter's venv module (e.g. apt-get install python3-venv)"
_FIX_ONLINE = (
    "check that the package index is reachable, or pass wheelhouse=DIR (--wheelhouse DIR) "
    "holding the wheels it needs"
)


@dataclass(frozen=True)
class RepoEnvironment:
    """A built test environment of one repository.

    Attributes:
        python: The venv's interpreter.
        root: The venv directory.
        requirements: What was installed, as sorted "name==version" strings.
        extra: The project's extra installed with it (None: none).
        group: The ``[dependency-groups]`` group installed with it (None: none).
    """

    python: Path
    root: Path
    requirements: tuple[str, ...]
    extra: str | None = None
    group: str | None = None

    def sandbox_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `LocalSubprocessSandbox` that run commands with this venv's
        interpreter; the venv is bound read-only (the sandbox hides /tmp, /root, /home)."""
        return {"python": str(self.python), "ro_binds": [str(self.root)]}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


_REQ_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")


def _requirement_name(spec: str) -> tuple[str, list[str]]:
    """(canonical name, extras) of a PEP 508 requirement string."""
    match = _REQ_NAME.match(spec)
    if match is None:
        raise ValueError(f"not a requirement: {spec!r}")
    extras = [e.strip() for e in (match.group(2) or "").split(",") if e.strip()]
    return _canonical(match.group(1)), extras


@dataclass(frozen=True)
class _Plan:
    """What to ask pip for: requirement strings, requirement files, and whether the
    repository itself (its build backend's metadata) is part of the request."""

    project: str | None
    requirements: tuple[str, ...]
    files: tuple[Path, ...]
    extra: str | None
    group: str | None
    via_backend: bool


def _pyproject(repo: Path) -> dict[str, Any]:
    path = repo / "pyproject.toml"
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot parse {str(path)!r} ({exc}); fix the file") from exc


def _first(names: Sequence[str], defined: Sequence[str]) -> str | None:
    """The first of ``names`` among ``defined``, spelled as ``defined`` spells it."""
    by_key = {_canonical(d): d for d in defined}
    for name in names:
        if _canonical(name) in by_key:
            return by_key[_canonical(name)]
    return None


def _expand_extra(project: str, optional: dict[str, list[str]], extra: str) -> list[str]:
    """The requirements of ``extra``, with references to the project's own extras expanded."""
    by_key = {_canonical(k): v for k, v in optional.items()}
    out: list[str] = []
    todo, seen = [extra], set()
    while todo:
        key = _canonical(todo.pop())
        if key in seen:
            continue
        seen.add(key)
        for spec in by_key.get(key, []):
            name, extras = _requirement_name(spec)
            if name == project:
                todo += extras
            else:
                out.append(spec)
    return out


def _dependency_group(groups: dict[str, Any], name: str) -> list[str]:
    """A PEP 735 group's requirement strings, ``include-group`` entries expanded."""
    by_key = {_canonical(k): v for k, v in groups.items()}
    out: list[str] = []
    todo, seen = [name], set()
    while todo:
        key = _canonical(todo.pop())
        if key in seen:
            continue
        seen.add(key)
        for entry in by_key.get(key, []):
            if isinstance(entry, str):
                out.append(entry)
            elif isinstance(entry, dict) and "include-group" in entry:
                todo.append(str(entry["include-group"]))
    return out


def _requirement_files(repo: Path, has_metadata: bool) -> list[Path]:
    """Requirement files named for tests (plain ``requirements.txt`` too without metadata)."""
    found: list[Path] = []
    for path in sorted(repo.glob("*.txt")):
        name = path.name.lower()
        if "req" in name and "test" in name:
            found.append(path)
    found += sorted(p for p in repo.glob("requirements/*.txt") if "test" in p.name.lower())
    for folder in ("tests", "test"):
        found += sorted((repo / folder).glob("requirements*.txt"))
    if not has_metadata and (repo / "requirements.txt").is_file():
        found.insert(0, repo / "requirements.txt")
    return [p for p in dict.fromkeys(found) if p.is_file()]


def _installable(repo: Path, pyproject: dict[str, Any]) -> bool:
    """Whether ``repo`` declares a package (not just tool settings in pyproject.toml or
    setup.cfg)."""
    if (repo / "setup.py").is_file() or {"project", "build-system"} & set(pyproject):
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


def _plan(repo: Path, extras: Sequence[str]) -> _Plan:
    data = _pyproject(repo)
    project_table = data.get("project")
    has_metadata = _installable(repo, data)
    files = tuple(_requirement_files(repo, has_metadata))
    groups = data.get("dependency-groups")
    group = _first(extras, list(groups)) if isinstance(groups, dict) else None
    group_reqs = _dependency_group(groups, group) if group and isinstance(groups, dict) else []
    if isinstance(project_table, dict) and isinstance(project_table.get("name"), str):
        dynamic = set(project_table.get("dynamic", []))
        if not dynamic & {"dependencies", "optional-dependencies"}:
            project = _canonical(project_table["name"])
            optional = dict(project_table.get("optional-dependencies", {}))
            extra = _first(extras, list(optional))
            requirements = list(project_table.get("dependencies", []))
            if extra is not None:
                requirements += _expand_extra(project, optional, extra)
            requirements += group_reqs
            return _Plan(project, tuple(requirements), files, extra, group, False)
    if not has_metadata:
        return _Plan(None, tuple(group_reqs), files, None, group, False)
    name = project_table.get("name") if isinstance(project_table, dict) else None
    project = _canonical(name) if isinstance(name, str) else None
    return _Plan(project, tuple(group_reqs), files, None, group, True)


def _interpreter(python: str) -> str:
    """A description of ``python`` that changes when it does (version, build, location)."""
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(sys.version, sys.implementation.cache_tag)"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise ValueError(
            f"interpreter {python!r} does not run ({exc}); pass python= an interpreter the "
            "sandbox can execute, e.g. /usr/bin/python3"
        ) from exc
    return f"{os.path.realpath(python)} {out.stdout.strip()}"


def _key(repo: Path, interpreter: str, extras: Sequence[str], wheelhouse: Path | None) -> str:
    digest = hashlib.sha256()
    digest.update(interpreter.encode())
    digest.update(json.dumps([list(extras), str(wheelhouse) if wheelhouse else None]).encode())
    declared = [repo / name for name in _METADATA_FILES]
    declared += sorted(repo.glob("*req*.txt")) + sorted(repo.glob("requirements/**/*.txt"))
    declared += sorted(repo.glob("test*/requirements*.txt"))
    for path in declared:
        if path.is_file():
            digest.update(path.relative_to(repo).as_posix().encode() + b"\0")
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


class _StepFailed(Exception):
    """A step (venv, pip) failed or ran out of time; ``reason`` is one line saying why."""

    def __init__(self, reason: str, *, timed_out: bool = False, backend: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.timed_out = timed_out
        self.backend = backend  # a build backend (pip's subprocess) failed


def _pip_error(output: str) -> tuple[str, bool]:
    """The line of pip's output that names what went wrong: the requirement it could not
    find, else what a build backend said last (with the step that failed), else pip's last
    error line; and whether a build backend failed."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for needle in ("No matching distribution found for", "Could not find a version"):
        hits = [line for line in lines if needle in line]
        if hits:
            return hits[-1], False
    if "[end of output]" in lines:  # a subprocess (the build backend) failed
        end = len(lines) - 1 - lines[::-1].index("[end of output]")
        said = [line for line in lines[:end] if not line.startswith("[")]
        steps = [line.lstrip("× ").rstrip(".") for line in lines[end:] if line.startswith("×")]
        if said:
            return (f"{steps[0]}: {said[-1]}" if steps else said[-1]), True
    errors = [line for line in lines if line.startswith("ERROR:")]
    if errors:
        return errors[-1], False
    rest = [line for line in lines if not line.startswith(("note:", "hint:"))]
    return (rest[-1] if rest else "no output"), False


def _run(argv: Sequence[str], *, cwd: Path, env: dict[str, str], deadline: float) -> str:
    """Run ``argv`` (in its own process group, killed whole on timeout); return its output or
    raise `_StepFailed`."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _StepFailed("ran out of time before it started", timed_out=True)
    proc = subprocess.Popen(
        list(argv),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=remaining)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise _StepFailed(f"timed out after {remaining:.0f} s", timed_out=True) from None
    if proc.returncode != 0:
        reason, backend = _pip_error(output)
        raise _StepFailed(reason, backend=backend)
    return output


def _host_pip() -> bool:
    """Whether this environment's pip can drive another interpreter (``--python``)."""
    try:
        version = importlib.metadata.version("pip")
    except importlib.metadata.PackageNotFoundError:
        return False
    parts = [int(p) for p in re.findall(r"\d+", version)[:2]]
    return tuple(parts) >= (22, 3)


def _pip_env(offline: bool) -> dict[str, str]:
    env = dict(os.environ)
    if offline:  # the wheelhouse is the only source: no configured index or find-links
        env = {k: v for k, v in env.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", PYTHONNOUSERSITE="1")
    return env


def _make_world_readable(root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in (*dirnames, *filenames):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                os.chmod(path, 0o755 if st.st_mode & 0o111 else 0o644)


def _retarget(tmp: Path, final: Path) -> None:
    """Rewrite the build path to the final one where a venv records it (script shebangs,
    activate scripts, pyvenv.cfg), so the renamed venv is whole."""
    old, new = str(tmp).encode(), str(final).encode()
    for path in [*(tmp / "bin").iterdir(), tmp / "pyvenv.cfg"]:
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if old in data:
            path.write_bytes(data.replace(old, new))


def declares_dependencies(repo: str | os.PathLike[str]) -> bool:
    """Whether ``repo`` declares anything its tests may need installed: static requirements,
    test requirement files or dependency groups, or packaging metadata that only its build
    backend can read (setup.py, dynamic dependencies)."""
    plan = _plan(Path(repo), ("test", "tests", "testing"))
    return bool(plan.requirements or plan.files or plan.via_backend)


def build_repo_environment(
    repo: str | os.PathLike[str],
    dest_root: str | os.PathLike[str],
    *,
    python: str = DEFAULT_PYTHON,
    wheelhouse: str | os.PathLike[str] | None = None,
    offline: bool = False,
    extras: Sequence[str] = ("test", "tests", "testing"),
    timeout_s: float = 900.0,
    progress: Callable[[str], None] | None = None,
) -> RepoEnvironment:
    """The venv with ``repo``'s declared dependencies under ``dest_root`` (built or reused).

    Args:
        repo: The repository root.
        dest_root: Where environments live (one subdirectory per key); every ancestor must
            be traversable by the sandbox uid (e.g. /tmp/cr-envs).
        python: The interpreter the venv is made from (default: the sandbox's).
        wheelhouse: A directory of wheels/sdists; pip then uses it alone (no index).
        offline: Refuse to reach an index; needs ``wheelhouse``.
        extras: Names of test extras / dependency groups; the first the project defines
            is installed.
        timeout_s: Limit for all pip work together.
        progress: Called with one line per step.

    Raises:
        ValueError: Bad arguments (no repository, ``offline`` without ``wheelhouse``, an
            unreachable ``dest_root``, an interpreter that does not run).
        RuntimeError: pip failed or timed out (one line: the repository, pip's error, the fix).
    """
    say = progress or (lambda _line: None)
    repo_path = Path(repo).resolve()
    if not repo_path.is_dir():
        raise ValueError(f"repository {str(repo)!r} is not a directory; pass its root")
    if offline and wheelhouse is None:
        raise ValueError(
            "offline=True needs wheelhouse=DIR (--wheelhouse DIR) holding the wheels the "
            "repository needs; pass one, or drop offline (--offline) to use the index"
        )
    house = Path(wheelhouse).resolve() if wheelhouse is not None else None
    if house is not None and not house.is_dir():
        raise ValueError(f"wheelhouse {str(wheelhouse)!r} is not a directory; pass one")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    root_dir = Path(dest_root).resolve()
    _check_reachable(root_dir)
    root_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    plan = _plan(repo_path, extras)
    target = root_dir / _key(repo_path, _interpreter(python), extras, house)
    marker = target / MARKER
    if marker.is_file():
        say(f"reusing {target}")
        return _load(target)
    deadline = time.monotonic() + timeout_s

    def build(tmp: Path) -> None:
        say(f"creating virtualenv {target}")
        host_pip = _host_pip()
        venv = [python, "-m", "venv", *(["--without-pip"] if host_pip else []), str(tmp)]
        env = _pip_env(house is not None)
        try:
            _run(venv, cwd=repo_path, env=env, deadline=deadline)
        except _StepFailed as exc:
            fix = _FIX_TIMEOUT if exc.timed_out else _FIX_VENV
            raise RuntimeError(
                f"cannot create a virtualenv for {repo_path} with {python!r}: {exc.reason}; {fix}"
            ) from None
        venv_python = tmp / "bin" / "python"
        if host_pip:
            pip = [sys.executable, "-m", "pip", "--python", str(venv_python)]
        else:
            pip = [str(venv_python), "-m", "pip"]
        sources = ["--no-index", "--find-links", str(house)] if house is not None else []
        requirements, extra = _resolve(plan, repo_path, pip, sources, extras, env, deadline, say)
        if requirements:
            names = ", ".join(spec for spec, _ in requirements)
            count = len(requirements)
            say(f"installing {count} dependenc{'y' if count == 1 else 'ies'}: {names}")
            argv = [*pip, "install", "--no-deps", "--quiet", *sources]
            argv += [url or spec for spec, url in requirements]
            _pip(argv, repo_path, env, deadline, house)
        _retarget(tmp, target)
        _make_world_readable(tmp)
        specs = [spec for spec, _ in requirements]
        record = {"requirements": specs, "extra": extra, "group": plan.group}
        (tmp / MARKER).write_text(json.dumps(record, indent=1) + "\n")
        os.chmod(tmp / MARKER, 0o644)

    build_dir_atomically(target, build, replace=False)
    say(f"environment ready: {target}")
    return _load(target)


def _check_reachable(path: Path) -> None:
    """As root the sandbox runs as another uid: every ancestor must be world-traversable."""
    if os.geteuid() != 0:
        return
    for ancestor in [*reversed(path.parents), path]:
        if not ancestor.exists():
            return  # made below with mode 0o755
        mode = os.stat(ancestor).st_mode
        if not mode & stat.S_IXOTH:
            raise ValueError(
                f"dest_root {str(path)!r} is not reachable by the sandbox uid: "
                f"{str(ancestor)!r} has mode {stat.filemode(mode)}; pick a directory every "
                "user can traverse, e.g. /tmp/cr-envs"
            )


def _load(target: Path) -> RepoEnvironment:
    record = json.loads((target / MARKER).read_text())
    return RepoEnvironment(
        python=target / "bin" / "python",
        root=target,
        requirements=tuple(record["requirements"]),
        extra=record.get("extra"),
        group=record.get("group"),
    )


def _pip(
    argv: Sequence[str], repo: Path, env: dict[str, str], deadline: float, house: Path | None
) -> str:
    try:
        return _run(argv, cwd=repo, env=env, deadline=deadline)
    except _StepFailed as exc:
        if exc.timed_out:
            fix = _FIX_TIMEOUT
        elif exc.backend:
            fix = _FIX_BACKEND
        elif house is not None:
            fix = _FIX_OFFLINE.format(wheelhouse=house)
        else:
            fix = _FIX_ONLINE
        raise RuntimeError(
            f"cannot install the test dependencies of {repo}: pip: {exc.reason}; {fix}"
        ) from None


def _dry_run(
    pip: Sequence[str],
    sources: Sequence[str],
    request: Sequence[str],
    repo: Path,
    env: dict[str, str],
    deadline: float,
    house: Path | None,
) -> dict[str, Any]:
    """pip's installation report for ``request`` (nothing is installed)."""
    with tempfile.TemporaryDirectory(prefix="cr-pip-report-") as scratch:
        report = Path(scratch) / "report.json"
        argv = [*pip, "install", "--dry-run", "--ignore-installed", "--quiet", *sources]
        _pip([*argv, "--report", str(report), *request], repo, env, deadline, house)
        return json.loads(report.read_text())


def _is_repo(item: dict[str, Any], repo: Path) -> bool:
    return str(item.get("download_info", {}).get("url", "")).rstrip("/") == repo.as_uri()


def _resolve(
    plan: _Plan,
    repo: Path,
    pip: Sequence[str],
    sources: Sequence[str],
    extras: Sequence[str],
    env: dict[str, str],
    deadline: float,
    say: Callable[[str], None],
) -> tuple[list[tuple[str, str | None]], str | None]:
    """pip's resolution of ``plan``: [("name==version", what to install: a "name @ URL" for
    a direct reference, else None)] without the repository itself, and the extra used."""
    house = Path(sources[-1]) if sources else None
    request = list(plan.requirements)
    for path in plan.files:
        request += ["-r", str(path)]
    if plan.via_backend:
        request.append(f"{repo}[{','.join(extras)}]" if extras else str(repo))
    if not request:
        say(f"{repo.name} declares no dependencies")
        return [], plan.extra
    say(f"resolving the dependencies of {repo}")
    report = _dry_run(pip, sources, request, repo, env, deadline, house)
    extra, project = plan.extra, plan.project
    if plan.via_backend:
        own = [i["metadata"] for i in report.get("install", []) if _is_repo(i, repo)]
        provided = {_canonical(e) for e in own[0].get("provides_extra") or []} if own else set()
        wanted = [e for e in extras if _canonical(e) in provided]
        extra = wanted[0] if wanted else None
        if len(wanted) > 1:  # only the first extra the project defines: ask for just that
            request[-1] = f"{repo}[{extra}]"
            report = _dry_run(pip, sources, request, repo, env, deadline, house)
        project = _canonical(own[0]["name"]) if own else project
    out = []
    for item in report.get("install", []):
        meta = item["metadata"]
        if _is_repo(item, repo) or _canonical(meta["name"]) == project:
            continue  # the repository itself (or a released copy of it) stays out
        spec = f"{_canonical(meta['name'])}=={meta['version']}"
        url = f"{meta['name']} @ {item['download_info']['url']}" if item.get("is_direct") else None
        out.append((spec, url))
    return sorted(out), extra
