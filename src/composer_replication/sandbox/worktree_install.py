"""A repository installed from its work tree: its metadata in the environment, its code in
the work tree where the agent edits it.

Tests of a repository often need it installed: ``importlib.metadata.version("pkg")``, entry
points, a console script, a test runner that imports the package itself (pytest imports
``packaging``, ``pluggy`` and ``iniconfig`` before any test). An editable install points
at one absolute path, but every task runs in a copy of the repository at a path of its own,
and a regular install would put a second, untouched copy of the code (the hidden answer of
every task) inside the environment. So the environment gets the repository the way an
editable install would, without either problem:

1. :func:`build_wheel` builds the repository's wheel with its own build backend, from a
   scratch copy (a build writes ``build/`` and ``*.egg-info`` into its source). A
   VCS-derived version without history (an sdist, a folder without ``.git``) comes from
   the sdist's ``PKG-INFO`` (``SETUPTOOLS_SCM_PRETEND_VERSION``).
2. pip installs that wheel; :func:`strip_to_metadata` then deletes every file of it but its
   ``.dist-info`` (metadata, entry points) and its scripts.
3. :func:`write_path_hook` puts a ``.pth`` file in the environment whose helper module adds
   the work tree's import roots (:func:`import_roots`: ``src`` in a src layout, the root in
   a flat one) to ``sys.path`` of every interpreter start: the work tree named by the
   ``COMPOSER_REPLICATION_WORKTREE`` variable (the sandbox sets it to the workdir), else the
   current directory. Like an editable install's path entry it comes after the standard
   library and site-packages; no released copy of the project is installed beside it.

Files the wheel's packages have and the work tree lacks (a version file a build backend
writes, e.g. setuptools-scm's ``_version.py``; a compiled extension module) are listed by
:func:`generated_files`: the caller adds them to its copy of the work tree, as an in-place
build would.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import zipfile
from collections.abc import Callable, Sequence
from email.parser import HeaderParser
from pathlib import Path

from composer_replication.sandbox.pytest_support import WORKTREE_ENV

__all__ = [
    "PATH_HOOK_MODULE",
    "WORKTREE_ENV",
    "build_environment",
    "build_wheel",
    "generated_files",
    "import_roots",
    "source_version",
    "strip_to_metadata",
    "wheel_dist_info",
    "wheel_extras",
    "wheel_top_level",
    "write_path_hook",
]

#: The helper module the ``.pth`` file imports at every interpreter start.
PATH_HOOK_MODULE = "_composer_replication_worktree"
# what a copy for building leaves out: caches and environments, never the sources or .git
_NOT_COPIED = shutil.ignore_patterns(
    "__pycache__", ".tox", ".nox", ".venv", "venv", ".pytest_cache", ".mypy_cache", "build", "dist"
)
_SKIP_ROOTS = frozenset({"build", "dist", "tests", "test", "testing", "docs", "doc"})


def source_version(repo: Path) -> str | None:
    """The version a VCS-derived build should report: ``PKG-INFO``'s ``Version`` when the
    repository has no ``.git`` (an unpacked sdist); None otherwise."""
    if (repo / ".git").exists():
        return None
    pkg_info = repo / "PKG-INFO"
    if not pkg_info.is_file():
        return None
    headers = HeaderParser().parsestr(pkg_info.read_text(encoding="utf-8", errors="replace"))
    version = headers.get("Version")
    return version.strip() if version else None


def build_environment(repo: Path) -> dict[str, str]:
    """Variables a build of ``repo`` needs beyond pip's: the pretended version where a
    VCS-derived one has no history (setuptools-scm, hatch-vcs and friends read it)."""
    version = source_version(repo)
    return {"SETUPTOOLS_SCM_PRETEND_VERSION": version} if version else {}


def build_wheel(
    repo: Path,
    wheel_dir: Path,
    *,
    pip: Sequence[str],
    sources: Sequence[str],
    run: Callable[[Sequence[str], Path, dict[str, str]], str],
) -> Path:
    """The wheel of ``repo``, built by pip (its build backend, isolated) from a scratch copy
    into ``wheel_dir``; ``run(argv, cwd, extra_env)`` runs pip and raises on failure."""
    scratch = wheel_dir / "source"
    shutil.copytree(repo, scratch, symlinks=True, ignore=_NOT_COPIED)
    try:
        argv = [*pip, "wheel", "--no-deps", "--quiet", *sources]
        run([*argv, "--wheel-dir", str(wheel_dir), str(scratch)], repo, build_environment(repo))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    wheels = sorted(wheel_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"the build of {repo} left {len(wheels)} wheels in {wheel_dir}")
    return wheels[0]


def wheel_dist_info(wheel: Path) -> str:
    """The ``<name>-<version>.dist-info`` folder of a wheel."""
    with zipfile.ZipFile(wheel) as zf:
        tops = {n.split("/", 1)[0] for n in zf.namelist() if "/" in n}
    infos = sorted(t for t in tops if t.endswith(".dist-info"))
    if len(infos) != 1:
        raise RuntimeError(f"{wheel.name} holds {len(infos)} .dist-info folders, not one")
    return infos[0]


def wheel_extras(wheel: Path) -> list[str]:
    """The extras a wheel's metadata provides (``Provides-Extra``)."""
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read(f"{wheel_dist_info(wheel)}/METADATA").decode("utf-8", errors="replace")
    return HeaderParser().parsestr(text).get_all("Provides-Extra") or []


def wheel_top_level(wheel: Path) -> list[str]:
    """The import names a wheel installs: its top-level packages and modules (``.pth`` and
    data folders left out)."""
    names: set[str] = set()
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.namelist():
            first = member.split("/", 1)[0]
            if first.endswith((".dist-info", ".data")):
                continue
            if "/" in member:
                names.add(first)
            elif member.endswith(".py"):
                names.add(member[: -len(".py")])
    return sorted(n for n in names if n.isidentifier())


def import_roots(repo: Path, names: Sequence[str]) -> tuple[str, ...]:
    """Repository-relative folders that hold the import names ``names`` (a package folder or
    a module file), nearest the root first; ``"."`` for the root itself."""
    roots: list[str] = []
    for name in names:
        found = _holder(repo, name)
        if found is not None:
            roots.append(found)
    return tuple(dict.fromkeys(roots))


def _holder(repo: Path, name: str) -> str | None:
    if (repo / name).is_dir() or (repo / f"{name}.py").is_file():
        return "."
    for dirpath, dirnames, filenames in os.walk(repo):
        here = Path(dirpath)
        dirnames[:] = sorted(
            d
            for d in dirnames
            if not d.startswith(".") and d not in _SKIP_ROOTS and not d.endswith(".egg-info")
        )
        if name in dirnames or f"{name}.py" in filenames:
            return here.relative_to(repo).as_posix()
    return None


def generated_files(wheel: Path, repo: Path, roots: Sequence[str]) -> dict[str, bytes]:
    """Files of the wheel's packages and modules that the work tree lacks, keyed by where
    they go in the work tree (under the root that holds their package): what the build
    generated (a version file, a compiled extension)."""
    out: dict[str, bytes] = {}
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.namelist():
            first = member.split("/", 1)[0]
            if member.endswith("/") or first.endswith((".dist-info", ".data")):
                continue
            for root in roots:
                target = (Path(root) / member).as_posix() if root != "." else member
                if (repo / Path(root) / first).exists() and not (repo / target).exists():
                    out[target] = zf.read(member)
                    break
    return out


def site_packages(venv: Path) -> Path:
    """The ``site-packages`` folder of a virtualenv."""
    found = sorted(venv.glob("lib/python*/site-packages"))
    if not found:
        raise RuntimeError(f"{venv} has no lib/python*/site-packages")
    return found[0]


def strip_to_metadata(site: Path, dist_info: str) -> list[str]:
    """Delete every file an installed distribution put in ``site`` except its ``.dist-info``
    folder and its scripts (outside ``site``); its ``RECORD`` is rewritten to what is left.
    Returns the removed paths (relative to ``site``)."""
    record = site / dist_info / "RECORD"
    rows = list(csv.reader(io.StringIO(record.read_text(encoding="utf-8"))))
    kept, removed = [], []
    for row in rows:
        if not row:
            continue
        rel = row[0]
        if rel.startswith(f"{dist_info}/") or rel.startswith("../"):
            kept.append(row)
            continue
        path = site / rel
        if path.is_file() or path.is_symlink():
            path.unlink()
        removed.append(rel)
    for rel in sorted({str(Path(r).parent) for r in removed}, key=len, reverse=True):
        folder = site / rel
        while folder != site and folder.is_dir():
            shutil.rmtree(folder / "__pycache__", ignore_errors=True)
            if any(folder.iterdir()):
                break
            folder.rmdir()
            folder = folder.parent
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(kept)
    record.write_text(text.getvalue(), encoding="utf-8")
    return removed


def write_path_hook(site: Path, roots: Sequence[str]) -> Path:
    """The ``.pth`` file (and its helper module) that adds the work tree's ``roots`` to
    ``sys.path`` at every interpreter start; returns the ``.pth`` file."""
    module = site / f"{PATH_HOOK_MODULE}.py"
    module.write_text(
        '"""Puts the work tree\'s import roots on sys.path: the repository installed from its\n'
        'work tree (written by composer_replication.sandbox.worktree_install)."""\n'
        "import os\nimport sys\n\n"
        f"ROOTS = {list(roots)!r}\n"
        f"try:\n    TREE = os.environ.get({WORKTREE_ENV!r}) or os.getcwd()\n"
        "except OSError:  # the current directory is gone\n    TREE = None\n"
        "for _root in ROOTS if TREE else ():\n"
        "    _path = os.path.normpath(os.path.join(TREE, _root))\n"
        "    if _path not in sys.path:\n"
        "        sys.path.append(_path)\n",
        encoding="utf-8",
    )
    pth = site / f"{PATH_HOOK_MODULE}.pth"
    pth.write_text(f"import {PATH_HOOK_MODULE}\n", encoding="utf-8")
    return pth
