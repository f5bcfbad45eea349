"""Tasks of a repository made on first use and kept (``datagen.repository_tasks``).

The repository is a copy of tests/fixtures/fd_repo; its tasks are generated for real (test
discovery, the gates, the reference agent in the real sandbox), two of them per
generation. The first call generates; the same arguments then reuse the folder; other
budgets make another folder; a folder left without its completion marker is made again.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from composer_replication.datagen.feature_deletion import AgentBudgets
from composer_replication.datagen.repository_tasks import (
    GENERATION_OPTIONS,
    SHIPPED_REPOSITORIES,
    repository_path,
    repository_tasks,
    resolve_repository_options,
)
from composer_replication.envs.fd_tasks import read_jsonl_records
from composer_replication.envs.feature_deletion import FeatureDeletionEnv
from composer_replication.model.loading import CACHE_ENV_VAR
from composer_replication.safety import HeldoutSplit
from composer_replication.sandbox.workdir import make_shared_tempdir

# the naming tests run in seconds; each test that generates takes about 20 s
pytestmark = pytest.mark.integration

FD_REPO = Path(__file__).resolve().parents[1] / "fixtures" / "fd_repo"
SPLIT = HeldoutSplit(0.25, "composer-replication")
MAX_TASKS = 2
MARKER = ".complete.json"


class Generation:
    """One generated cache: where, from which repository, and what it said."""

    def __init__(self, root: Path, tokenizer) -> None:
        self.root = root
        self.repo = root / "fd_repo"
        shutil.copytree(
            FD_REPO, self.repo, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache")
        )
        self.cache = root / "cache" / "tasks"  # where cache_dir() / "tasks" points, below
        self.tokenizer = tokenizer
        self.lines: list[str] = []
        self.task_file = self.call(say=self.lines.append)

    def call(self, cache: Path | None = None, say=None, **budgets) -> Path:
        return repository_tasks(
            str(self.repo),
            split=SPLIT,
            budgets=AgentBudgets(**budgets),
            tokenizer=self.tokenizer,
            max_tasks=MAX_TASKS,
            cache_root=cache or self.cache,
            say=say,
        )


@pytest.fixture(scope="module")
def generated(tokenizer) -> Iterator[Generation]:
    root = make_shared_tempdir("cr-repository-tasks-test-")
    try:
        yield Generation(root, tokenizer)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _task_ids(task_file: Path) -> list[str]:
    heldout = task_file.with_name("tasks.heldout.jsonl")
    records = read_jsonl_records(task_file)
    records += read_jsonl_records(heldout) if heldout.is_file() else []
    return [r["task_id"] for r in records]


# ------------------------------------------------------------------ naming a repository


def test_the_shipped_repository_is_found_by_name():
    assert SHIPPED_REPOSITORIES == ("smallkit",)
    path = repository_path("smallkit")
    assert path.is_dir() and path.name == "smallkit"
    assert path.parent.name == "repos" and path.parent.parent.name == "envs"
    assert (path / "pyproject.toml").is_file()
    assert (path / "smallkit" / "__init__.py").is_file()


def test_a_folder_is_found_by_path_and_anything_else_is_refused(tmp_path):
    assert repository_path(str(FD_REPO)) == FD_REPO.resolve()
    assert repository_path(str(FD_REPO / ".." / "fd_repo")) == FD_REPO.resolve()
    for bad in ("smallkitt", str(tmp_path / "missing"), str(FD_REPO / "pyproject.toml")):
        with pytest.raises(ValueError, match=f"repo {bad!r} is neither a folder nor a shipped"):
            repository_path(bad)


def test_other_environments_options_are_left_alone(tokenizer):
    options = {"repo": "smallkit", "max_tasks": 3, "difficulty": "easy"}
    kwargs = dict(max_new_tokens=256, split=SPLIT, tokenizer=tokenizer)
    got = resolve_repository_options("python_functions", options, **kwargs)
    assert got == options and got is not options
    task_file = {"task_file": "tasks.jsonl", "max_turns": 4}
    assert resolve_repository_options("feature_deletion", task_file, **kwargs) == task_file
    with pytest.raises(ValueError, match="name both repo and task_file; keep one"):
        resolve_repository_options(
            "feature_deletion", {"repo": "smallkit", "task_file": "t.jsonl"}, **kwargs
        )
    with pytest.raises(ValueError, match="repo 'no-such-repo' is neither a folder"):
        resolve_repository_options("feature_deletion", {"repo": "no-such-repo"}, **kwargs)


# ------------------------------------------------------------------ generated once, kept


@pytest.mark.slow
def test_the_first_call_generates_tasks_the_environment_loads(generated):
    task_file = generated.task_file
    folder = task_file.parent
    assert task_file.name == "tasks.jsonl" and folder.parent == generated.cache
    assert folder.name.startswith("fd_repo-") and len(folder.name) == len("fd_repo-") + 12
    assert (folder / MARKER).is_file()
    assert generated.lines[0] == (
        f"generating the tasks of {generated.repo} into {folder} (once; later runs reuse them)"
    )
    assert generated.lines[-1].endswith(f"from {generated.repo}")
    assert generated.lines[-1].startswith(f"{MAX_TASKS} tasks (")
    ids = _task_ids(task_file)
    assert len(ids) == MAX_TASKS and all(t.startswith("fd:fd_repo:textkit/") for t in ids)
    env = FeatureDeletionEnv(task_file)
    assert sorted(env.task_ids()) == sorted(ids)
    assert env.recorded_split == SPLIT
    assert all(env.workdirs[t].is_dir() for t in ids)
    # the marker records what the folder was made from
    key = json.loads((folder / MARKER).read_text())
    assert key["max_tasks"] == MAX_TASKS and key["split"] == SPLIT.to_record()
    assert key["budgets"] == AgentBudgets().environment_options() | {"max_new_tokens": 256}


@pytest.mark.slow
def test_the_same_arguments_reuse_the_folder(generated):
    task_file = generated.task_file
    before = {p.name: p.stat().st_mtime_ns for p in task_file.parent.iterdir()}
    lines: list[str] = []
    assert generated.call(say=lines.append) == task_file
    assert lines == []  # nothing generated, nothing said
    assert {p.name: p.stat().st_mtime_ns for p in task_file.parent.iterdir()} == before
    assert sorted(p.name for p in generated.cache.iterdir() if p.is_dir()) == [
        task_file.parent.name
    ]


@pytest.mark.slow
def test_a_run_entry_naming_the_repository_reads_the_kept_tasks(generated, monkeypatch):
    monkeypatch.setenv(CACHE_ENV_VAR, str(generated.cache.parent))
    lines: list[str] = []
    options = {"repo": str(generated.repo), "max_tasks": MAX_TASKS, "page_lines": 50}
    got = resolve_repository_options(
        "feature_deletion",
        options,
        max_new_tokens=256,
        split=SPLIT,
        tokenizer=generated.tokenizer,
        say=lines.append,
    )
    # the generation options are replaced by the task file; the environment's stay
    assert got == {"page_lines": 50, "task_file": str(generated.task_file)}
    assert not set(GENERATION_OPTIONS) & set(got)
    assert options["repo"] == str(generated.repo)  # the caller's options are not changed
    assert lines == []


@pytest.mark.slow
def test_other_budgets_make_another_folder(generated):
    lines: list[str] = []
    other = generated.call(say=lines.append, max_turns=6)
    assert other != generated.task_file
    assert other.parent.parent == generated.cache
    assert other.parent.name.startswith("fd_repo-") and (other.parent / MARKER).is_file()
    assert lines[0].startswith("generating the tasks of") and str(other.parent) in lines[0]
    key = json.loads((other.parent / MARKER).read_text())
    assert key["budgets"]["max_turns"] == 6
    assert len(_task_ids(other)) == MAX_TASKS
    # the first folder is untouched, and still what the first arguments give
    assert (generated.task_file.parent / MARKER).is_file()
    assert generated.call() == generated.task_file


@pytest.mark.slow
def test_a_folder_without_its_marker_is_made_again(generated):
    # the same folder name under another cache root: a generation that never finished
    cache = generated.root / "interrupted"
    unfinished = cache / generated.task_file.parent.name
    shutil.copytree(generated.task_file.parent, unfinished, symlinks=True)
    (unfinished / MARKER).unlink()
    (unfinished / "stale.txt").write_text("left by the interrupted generation\n")
    lines: list[str] = []
    task_file = generated.call(cache=cache, say=lines.append)
    assert task_file == unfinished / "tasks.jsonl"
    assert lines[0] == (
        f"generating the tasks of {generated.repo} into {unfinished} (once; later runs reuse them)"
    )
    assert (unfinished / MARKER).is_file() and not (unfinished / "stale.txt").exists()
    assert sorted(_task_ids(task_file)) == sorted(_task_ids(generated.task_file))
