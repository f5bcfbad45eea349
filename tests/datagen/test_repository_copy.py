"""A task's working copy holds the repository's own content: never an earlier generation's
outputs (the other tasks' working copies hold the bodies deleted here), and in a git work
tree only what git tracks."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from composer_replication.datagen.feature_deletion import generate_tasks
from composer_replication.datagen.repository_copy import (
    OUTPUT_MARKER,
    copy_repository,
    is_generation_output,
)
from composer_replication.sandbox.local import LocalSubprocessSandbox
from composer_replication.sandbox.workdir import make_shared_tempdir

FD_REPO = Path(__file__).resolve().parents[1] / "fixtures" / "fd_repo"
MEDIAN_BODY = "ordered = sorted(values)"  # the body the first generation deletes


def _factory(path: Path) -> LocalSubprocessSandbox:
    return LocalSubprocessSandbox(path, exec_timeout_s=60)


def _every_text(folder: Path) -> str:
    return "\n".join(
        p.read_text(errors="replace")
        for p in folder.rglob("*")
        if p.is_file() and not p.is_symlink()
    )


@pytest.mark.integration
def test_an_earlier_generations_outputs_inside_the_repository_are_never_copied() -> None:
    root = make_shared_tempdir("cr-copy-test-")
    try:
        repo = root / "fd_repo"
        shutil.copytree(
            FD_REPO, repo, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache")
        )
        first = generate_tasks(
            repo, root / "gen1" / "tasks.jsonl", max_tasks=1, sandbox_factory=_factory,
            only=["median"], environment="system",
    )  # fmt: skip
        assert first.accepted == 1
        workdirs = Path(first.workdirs)
        assert (workdirs / OUTPUT_MARKER).is_file()
        # the first task's working copy holds every other body: mean's among them
        (median_copy,) = [p for p in workdirs.iterdir() if p.is_dir()]
        assert "def mean" in (median_copy / "textkit" / "stats.py").read_text()
        # outputs can no longer be written into the repository, but an earlier
        # generation's may have been moved there; a task file under another name, too
        shutil.copytree(root / "gen1", repo / "gen1", symlinks=True)
        shutil.copy(repo / "gen1" / "tasks.heldout.jsonl", repo / "old_tasks.jsonl")
        second = generate_tasks(
            repo, root / "gen2" / "tasks.jsonl", max_tasks=1, sandbox_factory=_factory,
            only=["mean"], environment="system",
    )  # fmt: skip
        assert second.accepted == 1
        (mean_copy,) = [p for p in Path(second.workdirs).iterdir() if p.is_dir()]
        names = {str(p.relative_to(mean_copy)) for p in mean_copy.rglob("*")}
        assert not any(n.startswith(("gen1", "gen2", "old_tasks")) for n in names), names
        text = _every_text(mean_copy)
        assert "mean was removed; restore it" in text  # the stub of this task ...
        assert "fd:fd_repo:" not in text  # ... and no record of any generation
        body = json.loads(
            Path(second.output).with_name("tasks.reference.jsonl").read_text().splitlines()[0]
        )["body"]
        assert body.strip() and body.strip().splitlines()[-1] not in (
            (mean_copy / "textkit" / "stats.py").read_text()
        )  # the deleted body is nowhere in the working copy
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_git_work_tree_gives_its_tracked_files_only(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
    (repo / "README.md").write_text("readme\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "pkg/mod.py", "README.md"], check=True)
    subprocess.run([*git, "commit", "-qm", "init"], check=True)
    (repo / "pkg" / "mod.py").write_text("def f():\n    return 2\n")  # tracked, changed
    (repo / "notes.txt").write_text("untracked\n")
    (repo / "build").mkdir()
    (repo / "build" / "lib.py").write_text("untracked\n")
    copy_repository(repo, tmp_path / "copy")
    copied = sorted(str(p.relative_to(tmp_path / "copy")) for p in (tmp_path / "copy").rglob("*"))
    assert copied == ["README.md", "pkg", "pkg/mod.py"]
    assert (tmp_path / "copy" / "pkg" / "mod.py").read_text().endswith("return 2\n")  # on disk


def test_what_a_generation_wrote_is_known_by_its_marker_its_records_or_its_name(
    tmp_path: Path,
) -> None:
    (tmp_path / "out.workdirs").mkdir()
    (tmp_path / "out.workdirs" / OUTPUT_MARKER).write_text("")
    (tmp_path / "venv").mkdir()
    (tmp_path / "venv" / "pyvenv.cfg").write_text("home = /usr\n")
    (tmp_path / "renamed.jsonl").write_text('{"file": "a.py", "task_id": "swe:x__y-1"}\n')
    (tmp_path / "data.jsonl").write_text('{"task_id": "abc"}\n')  # a repository's own data
    (tmp_path / "t.split.json").write_text("{}")
    (tmp_path / "t.reference.jsonl").write_text("")
    (tmp_path / "old.jsonl").write_text('{"task_id": "fd:r:a.py:f"}\n')
    (tmp_path / "old.workdirs").mkdir()  # an older generation's, before the marker
    (tmp_path / "src").mkdir()
    known = {p.name for p in tmp_path.iterdir() if is_generation_output(p)}
    assert known == {
        "out.workdirs", "venv", "renamed.jsonl", "t.split.json", "t.reference.jsonl",
        "old.jsonl", "old.workdirs",
    }  # fmt: skip
