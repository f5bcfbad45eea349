"""`scrub_tree` removes every kind of solution leak and nothing else, never via symlinks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from composer_replication.sandbox.scrub import scrub_tree

LEAKS = [
    ".git/HEAD",
    ".git/objects/ab/cdef",
    ".hg/store/data",
    ".svn/entries",
    ".bzr/branch-format",
    "sub/.git",  # a gitfile of a submodule / worktree
    "pkg/__pycache__/mod.cpython-311.pyc",
    "pkg/stale.pyc",
    "pkg/opt.pyo",
    "pkg/mod.py.orig",
    "pkg/mod.py.rej",
    "pkg/mod.py.bak",
    "pkg/mod.py~",
    "pkg/.mod.py.swp",
    "pkg/.mod.py.swo",
    "pkg/#mod.py#",
    ".pytest_cache/v/cache/lastfailed",
    ".mypy_cache/3.11/pkg.json",
    ".ruff_cache/content",
    "pkg.egg-info/SOURCES.txt",
    ".eggs/dep.egg",
    ".tox/py311/lib/site.py",
    "build/lib/pkg/mod.py",
    "dist/pkg-1.0.tar.gz",
    "vendor/pkg-1.0-py3-none-any.whl",
    "vendor/pkg-1.0.tar.gz",
]
REMOVED_TOPS = {
    ".git",
    ".hg",
    ".svn",
    ".bzr",
    "sub/.git",
    "pkg/__pycache__",
    "pkg/stale.pyc",
    "pkg/opt.pyo",
    "pkg/mod.py.orig",
    "pkg/mod.py.rej",
    "pkg/mod.py.bak",
    "pkg/mod.py~",
    "pkg/.mod.py.swp",
    "pkg/.mod.py.swo",
    "pkg/#mod.py#",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    "pkg.egg-info",
    ".eggs",
    ".tox",
    "build",
    "dist",
    "vendor/pkg-1.0-py3-none-any.whl",
    "vendor/pkg-1.0.tar.gz",
    "link_out",
    "pkg/link_file_out",
}
KEPT = [
    "pkg/__init__.py",
    "pkg/mod.py",
    "pkg/build/__init__.py",  # a nested package called build is real source
    "pkg/dist/helpers.py",
    "tests/test_mod.py",
    ".github/workflows/ci.yml",
    "notes.txt",
    "data.tar",
]


def _make(root: Path, rel: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(rel)


def test_scrub_removes_every_leak_and_keeps_source(tmp_path: Path) -> None:
    root = tmp_path / "work"
    outside = tmp_path / "original_repo"
    for rel in LEAKS + KEPT:
        _make(root, rel)
    _make(outside, "pkg/mod.py")
    (root / "link_out").symlink_to(outside)  # a directory link leading out
    (root / "pkg" / "link_file_out").symlink_to(outside / "pkg" / "mod.py")
    (root / "pkg" / "link_inside").symlink_to("mod.py")  # stays inside: kept
    removed = scrub_tree(root)
    assert {p.relative_to(root).as_posix() for p in removed} == REMOVED_TOPS
    assert removed == sorted(removed)
    remaining = {
        (Path(d) / f).relative_to(root).as_posix() for d, _, files in os.walk(root) for f in files
    }
    assert remaining == set(KEPT) | {"pkg/link_inside"}
    assert (outside / "pkg" / "mod.py").read_text() == "pkg/mod.py"  # never followed


def test_scrub_never_deletes_through_a_leak_named_symlink(tmp_path: Path) -> None:
    root = tmp_path / "work"
    root.mkdir()
    elsewhere = tmp_path / "elsewhere_cache"
    _make(elsewhere, "keep.txt")
    (root / "__pycache__").symlink_to(elsewhere)
    assert scrub_tree(root) == [root / "__pycache__"]
    assert (elsewhere / "keep.txt").exists()


def test_scrub_is_idempotent(tmp_path: Path) -> None:
    root = tmp_path / "work"
    _make(root, ".git/HEAD")
    _make(root, "a.py")
    assert len(scrub_tree(root)) == 1
    assert scrub_tree(root) == []


def test_scrub_refuses_symlinked_or_missing_workdir(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real)
    with pytest.raises(ValueError, match="not a symlink"):
        scrub_tree(tmp_path / "alias")
    with pytest.raises(ValueError, match="real directory"):
        scrub_tree(tmp_path / "missing")
