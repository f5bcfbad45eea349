"""A repository's test environment: a virtualenv holding the repository as its maintainers
install it for testing, for running its tests in a sandbox.

`build_repo_environment(repo, dest_root)` makes (or reuses) a venv with
- the repository itself, installed from its work tree (``sandbox.worktree_install``): its
  metadata and entry points in the venv, its code imported from whichever work tree the
  sandbox runs in (``COMPOSER_REPLICATION_WORKTREE``), never a copy of the code in the venv;
- its dependencies and what its tests need, from every place it declares them
  (``sandbox.test_dependencies``: test extras, PEP 735 groups, test requirement files, tox);
- pytest, so the test runner lives in the environment with the plugins the repository
  declares; their modules are recorded (``RepoEnvironment.pytest_plugins``) so a test
  command can load exactly those (``-p``) while plugin autoloading stays off in the
  sandbox (nothing the agent writes in the work tree can register a plugin).
`RepoEnvironment.sandbox_kwargs()` gives the `LocalSubprocessSandbox` arguments that run
tests with that venv's interpreter.

How dependencies are resolved (pip decides, we only choose what to ask for): the
repository's wheel is built first (its build backend, isolated); pip then resolves the wheel
with its test extras, the test requirements and pytest once (``--dry-run --ignore-installed
--report``), and we install exactly the reported distributions with ``--no-deps``, leaving
out the project's own name (a dependency that depends back on the project cannot pull a
released copy in). Where the wheel cannot be built (a broken or unavailable backend), the
project's static dependencies stand in for it and the environment says so
(``RepoEnvironment.note``); where the whole request does not resolve (a pinned file for
another Python), pip is asked again for the project and pytest alone, and the note says
what was left out.

Where pip comes from: the venv is made with ``python -m venv --without-pip`` (tens of
milliseconds instead of seconds) and driven by this environment's pip through
``pip --python <venv python>`` (pip >= 22.3); without such a pip, the venv bootstraps its own
with ``ensurepip``.

Offline: ``wheelhouse=DIR`` runs pip with ``--no-index --find-links DIR`` and no pip
configuration or ``PIP_*`` variables from the environment, so DIR is the only source: it
needs pytest and its requirements, the dependencies, and the repository's build backend
(e.g. setuptools, flit-core or hatchling) for its wheel.

Reuse: the venv lives in ``dest_root/<key>``, ``key`` a hash of the interpreter, the
dependency declaration files, ``extras`` and the wheelhouse, so all tasks of one repository
share it and a second run costs nothing. It is built in a temporary sibling and renamed into
place only when complete (a marker file is its last write), so nothing half-built is ever
reused; on failure the sibling is removed. Everything in it is world-readable (directories
0o755, files 0o644, or 0o755 with an execute bit) so the sandbox's unprivileged uid can run it.

What this does not do: install system libraries, compile extensions into the work tree, or
make test-time network access work (the sandbox has none).
"""

from __future__ import annotations

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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from composer_replication.common.atomic_io import build_dir_atomically
from composer_replication.sandbox.pytest_support import SYSTEM_PYTHON
from composer_replication.sandbox.test_dependencies import (
    TEST_EXTRAS,
    DependencyPlan,
    canonical_name,
    pick_extra,
    plan_dependencies,
)
from composer_replication.sandbox.worktree_install import (
    build_wheel,
    generated_files,
    import_roots,
    site_packages,
    strip_to_metadata,
    wheel_dist_info,
    wheel_extras,
    wheel_top_level,
    write_path_hook,
)

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
# bump when what an environment holds changes: older ones are then built again
_LAYOUT_VERSION = 2
_GENERATED = "generated"  # where a venv keeps the files its repository's build generated
_DECLARATION_FILES = ("pyproject.toml", "setup.cfg", "setup.py", "tox.ini", "tox.toml", "PKG-INFO")
_FIX_OFFLINE = (
    "put the missing distributions in the wheelhouse (pip download -d {wheelhouse} ...; "
    "pytest and the repository's build backend belong there too)"
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
        requirements: What was installed, as sorted "name==version" strings (the project's
            own metadata not among them).
        extra: The project's extra installed with it (None: none).
        group: The ``[dependency-groups]`` group installed with it (None: none).
        project: The installed project's "name==version" (None: the repository is not
            installed: it declares no package, or its build failed: ``note`` says).
        roots: Work-tree folders the venv's interpreter imports the project from.
        pytest_plugins: Names of the pytest plugins installed (entry points; the project's
            own left out), in the order they load.
        generated: Files the build generated that the work tree lacks (relative paths; the
            copies are under ``root / "generated"``).
        sources: Where the test requirements came from, one line each.
        note: What could not be installed as declared, and why ("" when all was).
    """

    python: Path
    root: Path
    requirements: tuple[str, ...]
    extra: str | None = None
    group: str | None = None
    project: str | None = None
    roots: tuple[str, ...] = ()
    pytest_plugins: tuple[str, ...] = ()
    generated: tuple[str, ...] = ()
    sources: tuple[str, ...] = field(default_factory=tuple)
    note: str = ""

    def sandbox_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `LocalSubprocessSandbox` that run commands with this venv's
        interpreter; the venv is bound read-only (the sandbox hides /tmp, /root, /home)."""
        return {"python": str(self.python), "ro_binds": [str(self.root)]}

    def plugin_options(self) -> list[str]:
        """The pytest options that load the environment's plugins (``-p NAME`` each: a
        plugin the repository's configuration blocks with ``-p no:NAME`` stays blocked)."""
        return [arg for name in self.pytest_plugins for arg in ("-p", name)]

    def add_generated(self, workdir: str | os.PathLike[str]) -> list[str]:
        """Copy the files the build generated into a copy of the repository where it lacks
        them; returns those added."""
        added = []
        for rel in self.generated:
            target = Path(workdir) / rel
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes((self.root / _GENERATED / rel).read_bytes())
                added.append(rel)
        return added


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
    digest.update(f"layout {_LAYOUT_VERSION}\0{interpreter}".encode())
    digest.update(json.dumps([list(extras), str(wheelhouse) if wheelhouse else None]).encode())
    declared = [repo / name for name in _DECLARATION_FILES]
    declared += sorted(repo.glob("*req*.txt")) + sorted(repo.glob("requirements/**/*.txt"))
    declared += sorted(repo.glob("test*/requirements*.txt"))
    for path in declared:
        if path.is_file():
            digest.update(path.relative_to(repo).as_posix().encode() + b"\0")
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


class _TimedOut(RuntimeError):
    """pip ran out of the environment's time: nothing after it can run either."""


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
    """Whether ``repo`` declares a package, or anything its tests may need installed (test
    requirement files, dependency groups, tox dependencies)."""
    return plan_dependencies(Path(repo)).declares_anything


def build_repo_environment(
    repo: str | os.PathLike[str],
    dest_root: str | os.PathLike[str],
    *,
    python: str = DEFAULT_PYTHON,
    wheelhouse: str | os.PathLike[str] | None = None,
    offline: bool = False,
    extras: Sequence[str] = TEST_EXTRAS,
    timeout_s: float = 900.0,
    progress: Callable[[str], None] | None = None,
) -> RepoEnvironment:
    """The venv of ``repo``'s tests under ``dest_root`` (built or reused; module docstring).

    Args:
        repo: The repository root.
        dest_root: Where environments live (one subdirectory per key); every ancestor must
            be traversable by the sandbox uid (e.g. /tmp/cr-envs).
        python: The interpreter the venv is made from (default: the sandbox's).
        wheelhouse: A directory of wheels/sdists; pip then uses it alone (no index).
        offline: Refuse to reach an index; needs ``wheelhouse``.
        extras: Names of test extras / dependency groups, preferred in order (``dev`` when
            the project defines none of them).
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
    plan = plan_dependencies(repo_path, extras)
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
        step = _Steps(pip, sources, repo_path, env, deadline, house)
        record = _install(plan, step, tmp, extras, say)
        _retarget(tmp, target)
        _make_world_readable(tmp)
        (tmp / MARKER).write_text(json.dumps(record, indent=1) + "\n")
        os.chmod(tmp / MARKER, 0o644)

    build_dir_atomically(target, build, replace=False)
    say(f"environment ready: {target}")
    return _load(target)


@dataclass(frozen=True)
class _Steps:
    """How pip runs for one environment: its command, sources, directory, variables and
    the deadline all its steps share."""

    pip: Sequence[str]
    sources: Sequence[str]
    repo: Path
    env: dict[str, str]
    deadline: float
    house: Path | None

    def run(self, argv: Sequence[str], extra_env: dict[str, str] | None = None) -> str:
        env = {**self.env, **(extra_env or {})}
        return _pip(argv, self.repo, env, self.deadline, self.house)

    def dry_run(self, request: Sequence[str]) -> dict[str, Any]:
        """pip's installation report for ``request`` (nothing is installed)."""
        with tempfile.TemporaryDirectory(prefix="cr-pip-report-") as scratch:
            report = Path(scratch) / "report.json"
            argv = [*self.pip, "install", "--dry-run", "--ignore-installed", "--quiet"]
            self.run([*argv, *self.sources, "--report", str(report), *request])
            return json.loads(report.read_text())


def _install(
    plan: DependencyPlan,
    step: _Steps,
    venv: Path,
    names: Sequence[str],
    say: Callable[[str], None],
) -> dict[str, Any]:
    """Install the repository (from its work tree), what its tests need and pytest into
    ``venv``; returns the marker record. ``names``: the test extras, preferred in order."""
    notes: list[str] = []
    wheel, project = None, None
    with tempfile.TemporaryDirectory(prefix="cr-wheel-") as scratch:
        if plan.installable:
            say(f"building {step.repo.name}'s wheel")
            try:
                wheel = build_wheel(
                    step.repo,
                    Path(scratch),
                    pip=step.pip,
                    sources=step.sources,
                    run=lambda argv, _cwd, extra: step.run(argv, extra),
                )
            except _TimedOut:
                raise
            except RuntimeError as exc:
                notes.append(f"the repository is not installed: its build failed ({exc})")
                say(f"not installing {step.repo.name} itself: {exc}")
        project = canonical_name(wheel.name.split("-", 1)[0]) if wheel else plan.project
        if wheel is not None and not plan.extras:  # extras only the build backend knows
            extra = pick_extra(wheel_extras(wheel), names)
            plan = replace(plan, extras=(extra,) if extra else ())
        resolved, dropped = _resolve(plan, step, wheel, project, say)
        if dropped:
            notes.append(f"left out (they do not resolve together): {dropped}")
        specs = [spec for spec, _ in resolved]
        if resolved:
            count = len(resolved)
            say(f"installing {count} distribution{'s' if count != 1 else ''}: {', '.join(specs)}")
            argv = [*step.pip, "install", "--no-deps", "--quiet", *step.sources]
            step.run([*argv, *(url or spec for spec, url in resolved)])
        record: dict[str, Any] = {
            "requirements": specs,
            "extra": plan.extras[0] if plan.extras else None,
            "group": plan.groups[0] if plan.groups else None,
            "sources": list(plan.sources),
        }
        if wheel is not None:
            record.update(_install_project(wheel, step, venv, say))
    record["pytest_plugins"] = _pytest_plugins(venv, record.get("project_name"))
    record["note"] = "; ".join(notes)
    return record


def _install_project(
    wheel: Path, step: _Steps, venv: Path, say: Callable[[str], None]
) -> dict[str, Any]:
    """Install ``wheel``'s metadata and scripts (not its code) and the path hook to the
    work tree; returns what the marker records of it."""
    roots = import_roots(step.repo, wheel_top_level(wheel))
    step.run([*step.pip, "install", "--no-deps", "--quiet", *step.sources, str(wheel)])
    site = site_packages(venv)
    info = wheel_dist_info(wheel)
    strip_to_metadata(site, info)
    write_path_hook(site, roots)
    generated = generated_files(wheel, step.repo, roots)
    for rel, data in generated.items():
        path = venv / _GENERATED / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    name, version = info[: -len(".dist-info")].rsplit("-", 1)
    say(
        f"installed {name} {version} from the work tree (imports from "
        f"{', '.join(roots) or 'nowhere: no package folder found'})"
    )
    return {
        "project": f"{canonical_name(name)}=={version}",
        "project_name": canonical_name(name),
        "roots": list(roots),
        "generated": sorted(generated),
    }


def _pytest_plugins(venv: Path, project: str | None) -> list[str]:
    """Names of the pytest plugins (``pytest11`` entry points) installed in ``venv``, the
    project's own left out: by distribution, each in the order it declares them (so a
    package's plugin loads before its submodules', as autoloading would load them)."""
    code = (
        "import importlib.metadata as m, json, re\n"
        "out = []\n"
        "for d in m.distributions():\n"
        "    name = re.sub(r'[-_.]+', '-', d.metadata['Name'] or '').lower()\n"
        "    out += [(name, ep.name) for ep in d.entry_points if ep.group == 'pytest11']\n"
        "print(json.dumps(out))\n"
    )
    try:
        done = subprocess.run(
            [str(venv / "bin" / "python"), "-I", "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"cannot list the pytest plugins of {venv}: {exc}") from None
    found = sorted(enumerate(json.loads(done.stdout)), key=lambda item: (item[1][0], item[0]))
    names = [ep for _, (dist, ep) in found if dist != project]
    return list(dict.fromkeys(names))


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
        project=record.get("project"),
        roots=tuple(record.get("roots", ())),
        pytest_plugins=tuple(record.get("pytest_plugins", ())),
        generated=tuple(record.get("generated", ())),
        sources=tuple(record.get("sources", ())),
        note=record.get("note", ""),
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
        error = _TimedOut if exc.timed_out else RuntimeError
        raise error(
            f"cannot install the test dependencies of {repo}: pip: {exc.reason}; {fix}"
        ) from None


def _resolve(
    plan: DependencyPlan,
    step: _Steps,
    wheel: Path | None,
    project: str | None,
    say: Callable[[str], None],
) -> tuple[list[tuple[str, str | None]], str]:
    """pip's resolution of what the tests need: [("name==version", what to install: a
    "name @ URL" for a direct reference, else None)] without the project itself, and what
    had to be left out for the rest to resolve ("" when nothing)."""
    if wheel is not None:
        core = [f"{wheel}[{','.join(plan.extras)}]" if plan.extras else str(wheel)]
    else:
        core = list(plan.static_dependencies or ())
    if not any(canonical_name(_name(r)) == "pytest" for r in [*core, *plan.requirements]):
        core.append("pytest")
    declared = list(plan.requirements)
    for path in plan.files:
        declared += ["-r", str(path)]
    say(f"resolving the test dependencies of {step.repo.name}")
    dropped = ""
    try:
        report = step.dry_run([*core, *declared])
    except _TimedOut:
        raise
    except RuntimeError as exc:
        if not declared:
            raise
        dropped = ", ".join(plan.sources) or "the declared test requirements"
        say(f"the declared test requirements do not resolve ({exc}); trying without them")
        report = step.dry_run(core)
    out = []
    for item in report.get("install", []):
        meta = item["metadata"]
        if canonical_name(meta["name"]) == project:
            continue  # the repository itself (or a released copy of it) stays out
        spec = f"{canonical_name(meta['name'])}=={meta['version']}"
        url = f"{meta['name']} @ {item['download_info']['url']}" if item.get("is_direct") else None
        out.append((spec, url))
    return sorted(out), dropped


def _name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    return match.group(1) if match else ""
