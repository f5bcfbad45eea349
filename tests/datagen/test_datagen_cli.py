"""The datagen command: progress, per-gate summary table, task files, exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from composer_replication.datagen.cli import app, datagen_main
from composer_replication.envs.fd_tasks import make_task_id, read_jsonl_records
from composer_replication.safety.holdout import HeldoutSplit


@pytest.mark.integration
@pytest.mark.slow
def test_datagen_command_writes_one_task_and_prints_the_gate_table(
    fd_repo_copy: Path, shared_dir: Path
) -> None:
    out = shared_dir / "out" / "tasks.jsonl"
    result = CliRunner().invoke(app, [str(fd_repo_copy), "-o", str(out), "--max-tasks", "1"])
    assert result.exit_code == 0, result.output
    for row in ("accepted (train)", "rejected: not_referenced", "rejected: gate2_targets_red"):
        assert row in result.output
    # `register` comes first but no test names it; `shout` is the first accepted task.
    shout = make_task_id("fd_repo", "textkit/formatters.py", "shout")
    held = HeldoutSplit().is_heldout(shout)
    train_rows = read_jsonl_records(out)
    held_rows = read_jsonl_records(out.with_name("tasks.heldout.jsonl"))
    assert [r["task_id"] for r in (held_rows if held else train_rows)] == [shout]
    assert (train_rows if held else held_rows) == []
    assert out.with_name("tasks.reference.jsonl").stat().st_mode & 0o777 == 0o600


def test_datagen_main_rejects_unusable_input(shared_dir: Path) -> None:
    console = Console(record=True, width=120)
    assert datagen_main(shared_dir / "missing", shared_dir / "t.jsonl", 3, console=console) == 2
    assert "is not a directory" in console.export_text()
    assert datagen_main(shared_dir, shared_dir / "t.jsonl", 0, console=console) == 2


def test_help_answers_without_running_anything() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "--max-tasks" in result.output and "--output" in result.output


@pytest.mark.integration
@pytest.mark.slow
def test_datagen_twice_never_reads_its_own_outputs_and_never_writes_into_the_repo(
    fd_repo_copy: Path,
) -> None:
    before = {p: p.read_bytes() for p in fd_repo_copy.rglob("*") if p.is_file()}
    for inside in (fd_repo_copy / "generated" / "tasks.jsonl", fd_repo_copy / "pyproject.toml"):
        refused = CliRunner().invoke(app, [str(fd_repo_copy), "-o", str(inside)])
        assert refused.exit_code == 2, refused.output
        assert "is inside the input folder" in refused.output
        assert "Traceback" not in refused.output
    assert {p: p.read_bytes() for p in fd_repo_copy.rglob("*") if p.is_file()} == before
    out = fd_repo_copy.parent / "generated" / "tasks.jsonl"
    (fd_repo_copy / "notes.reference.md").write_text("a hidden answer\n")  # any *.reference.*
    args = [str(fd_repo_copy), "-o", str(out), "--max-tasks", "2"]
    for _ in range(2):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
    rows = read_jsonl_records(out) + read_jsonl_records(out.with_name("tasks.heldout.jsonl"))
    assert rows
    for row in rows:
        workdir = Path(row["workdir"])
        on_disk = [p.relative_to(workdir).as_posix() for p in workdir.rglob("*")]
        for listing in (row["files"], on_disk):
            assert not [f for f in listing if "generated" in f or ".reference." in f], listing
    # a run that accepts nothing leaves every earlier task file as it was; its candidates
    # report says why nothing was accepted
    report = out.with_name("tasks.candidates.jsonl")

    def task_files():
        return {p: p.read_bytes() for p in out.parent.iterdir() if p.is_file() and p != report}

    before = task_files()
    with open(fd_repo_copy / "textkit" / "__init__.py", "a") as fh:  # no test can pass now
        fh.write("\nraise RuntimeError('broken_on_purpose')\n")
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1 and "no task file written" in result.output
    assert task_files() == before
    rows = read_jsonl_records(report)
    assert rows and {r["gate"] for r in rows} == {"gate1_original_green"}
    assert all("no test of the original suite passes" in r["reason"] for r in rows)
    assert all("broken_on_purpose" in r["reason"] for r in rows)


def test_datagen_refuses_unusable_outputs_before_any_work(shared_dir: Path) -> None:
    repo = shared_dir / "repo"
    repo.mkdir()
    (shared_dir / "tasks.workdirs").write_text("a file where the workdirs folder goes")
    for output, needle in (
        (shared_dir, "is a directory"),
        (Path("/dev/null"), "is a character device"),
        (shared_dir / "tasks.jsonl", "is a regular file, not a directory"),
    ):
        result = CliRunner().invoke(app, [str(repo), "-o", str(output)])
        assert result.exit_code == 2, result.output
        assert needle in result.output and "Traceback" not in result.output
    assert sorted(p.name for p in shared_dir.iterdir()) == ["repo", "tasks.workdirs"]


def test_a_module_that_does_not_parse_is_named(shared_dir: Path) -> None:
    repo = shared_dir / "broken"
    (repo / "tests").mkdir(parents=True)
    (repo / "calc.py").write_text("def add(a, b)\n    return a + b\n")
    (repo / "tests" / "test_calc.py").write_text(
        "from calc import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n"
    )
    result = CliRunner().invoke(
        app, [str(repo), "-o", str(shared_dir / "out" / "t.jsonl"), "--environment", "system"]
    )
    assert result.exit_code == 1, result.output
    assert "no candidate: calc.py does not parse (line 1: expected ':'); fix the syntax error" in (
        " ".join(result.output.split())
    )
    assert "Traceback" not in result.output
