"""Shared fixtures: world-traversable temp dirs for sandboxes and the FD fixture repo."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from composer_replication.sandbox.local import LocalSubprocessSandbox
from composer_replication.sandbox.workdir import make_shared_tempdir

FD_REPO = Path(__file__).resolve().parent / "fixtures" / "fd_repo"


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A 0755 temp dir the sandbox uid (nobody) can reach; pytest's tmp_path is 0700."""
    path = make_shared_tempdir("cr-datagen-test-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def workdir(shared_dir: Path) -> Path:
    path = shared_dir / "work"
    path.mkdir()
    return path


@pytest.fixture
def fd_repo_copy(shared_dir: Path) -> Path:
    """A fresh copy of tests/fixtures/fd_repo named `fd_repo` (task ids contain the name)."""
    dest = shared_dir / "fd_repo"
    shutil.copytree(FD_REPO, dest, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    return dest


@pytest.fixture
def sandbox_factory() -> Callable[[Path], LocalSubprocessSandbox]:
    def factory(path: Path) -> LocalSubprocessSandbox:
        return LocalSubprocessSandbox(path, exec_timeout_s=60)

    return factory
