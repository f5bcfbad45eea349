"""Remove solution leaks from a task workdir before the sandbox boots.

A FeatureDeletion task deletes a function body; the original must not survive anywhere the
agent can read it. Leaks removed here:
- version-control directories and history (`.git` dirs and gitfiles, `.hg`, `.svn`, `.bzr`):
  `git show HEAD:file` would print the reference;
- bytecode (`__pycache__`, `*.pyc`, `*.pyo`): decompilable copies of the original;
- tool caches (`.pytest_cache`, `.mypy_cache`, `.ruff_cache`): they keep test ids, types and
  sometimes source snippets of the original;
- editor and patch leftovers (`*.orig`, `*.rej`, `*.bak`, `*~`, `.*.swp`, `.*.swo`, `#*#`);
- packaged copies of the source: `*.egg-info`, `.eggs`, `.tox`, `.nox`, `*.whl`, `*.tar.gz`
  sdists, and the top-level `build/` and `dist/` directories (nested directories with those
  names are left alone: they are often real packages);
- symlinks that point outside the workdir (they could lead back to the original repository).

Symlinks are never followed: a link is removed as a link, never through its target.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from pathlib import Path

__all__ = ["LEAK_DIR_NAMES", "LEAK_FILE_PATTERNS", "TOP_LEVEL_LEAK_DIRS", "scrub_tree"]

LEAK_DIR_NAMES: frozenset[str] = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        ".bzr",
        "__pycache__",
        ".pytest_cache",
        ".mypy_cache",
        ".ruff_cache",
        ".eggs",
        ".tox",
        ".nox",
    }
)
LEAK_DIR_PATTERNS: tuple[str, ...] = ("*.egg-info",)
TOP_LEVEL_LEAK_DIRS: frozenset[str] = frozenset({"build", "dist"})
LEAK_FILE_PATTERNS: tuple[str, ...] = (
    ".git",  # a gitfile pointing at a worktree's history
    "*.pyc",
    "*.pyo",
    "*.orig",
    "*.rej",
    "*.bak",
    "*~",
    ".*.swp",
    ".*.swo",
    "#*#",
    "*.whl",
    "*.tar.gz",
)


def _is_leak_dir(name: str, top_level: bool) -> bool:
    if name in LEAK_DIR_NAMES or (top_level and name in TOP_LEVEL_LEAK_DIRS):
        return True
    return any(fnmatch.fnmatchcase(name, p) for p in LEAK_DIR_PATTERNS)


def _is_leak_file(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in LEAK_FILE_PATTERNS)


def _escapes(link: Path, root: Path) -> bool:
    target = Path(os.path.normpath(link.parent / os.readlink(link)))
    try:
        target.relative_to(root)
    except ValueError:
        return True
    return False


def scrub_tree(workdir: str | os.PathLike[str]) -> list[Path]:
    """Delete solution leaks under `workdir`; return the removed paths (sorted).

    A removed directory is listed once (not its contents). Raises `ValueError` when
    `workdir` is not a directory or is itself a symlink.
    """
    given = Path(workdir)
    if given.is_symlink() or not given.is_dir():
        raise ValueError(f"scrub_tree needs a real directory (not a symlink), got {str(workdir)!r}")
    root = given.resolve()
    removed: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root, topdown=True, followlinks=False):
        here = Path(dirpath)
        top_level = here == root
        keep: list[str] = []
        for name in dirnames:
            path = here / name
            if path.is_symlink():  # os.walk lists links to dirs as dirs; never descend
                if _is_leak_dir(name, top_level) or _escapes(path, root):
                    path.unlink()
                    removed.append(path)
                continue
            if _is_leak_dir(name, top_level):
                shutil.rmtree(path)
                removed.append(path)
            else:
                keep.append(name)
        dirnames[:] = keep
        for name in filenames:
            path = here / name
            if _is_leak_file(name) or (path.is_symlink() and _escapes(path, root)):
                path.unlink()
                removed.append(path)
    return sorted(removed)
