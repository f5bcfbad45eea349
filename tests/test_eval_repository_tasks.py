"""``composer-replication eval --env feature_deletion``: repository tasks scored from the CLI.

Two tasks are generated for real from a copy of tests/fixtures/fd_repo; the tiny random
model then attempts each once through the real agent loop and sandbox. It never writes a
tool call, so each episode ends answered or cut off in its first turn and nothing is
solved. The printed table, the ``-o`` JSON and the ``--rollouts`` file are checked, and
the usage errors that refuse a bad command line before the model loads.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from composer_replication.cli import app
from composer_replication.datagen.feature_deletion import generate_tasks
from composer_replication.sandbox.local import LocalSubprocessSandbox
from composer_replication.sandbox.workdir import make_shared_tempdir

pytestmark = pytest.mark.integration

FD_REPO = Path(__file__).resolve().parent / "fixtures" / "fd_repo"
TASK_IDS = ["fd:fd_repo:textkit/stats.py:median", "fd:fd_repo:textkit/words.py:word_count"]
WIDE = {"COLUMNS": "200"}  # the table on one line per row


@pytest.fixture(scope="module")
def task_file() -> Iterator[Path]:
    root = make_shared_tempdir("cr-eval-repository-test-")
    repo = root / "fd_repo"
    shutil.copytree(FD_REPO, repo, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    report = generate_tasks(
        repo,
        root / "out" / "tasks.jsonl",
        max_tasks=2,
        sandbox_factory=lambda path: LocalSubprocessSandbox(path, exec_timeout_s=60),
        only=["median", "word_count"],
        split=None,  # both are training tasks: the evaluation takes --split all
        environment="system",
    )
    assert (report.accepted, report.train, report.heldout) == (2, 2, 0)
    yield Path(report.output)
    shutil.rmtree(root, ignore_errors=True)


def _error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def test_eval_scores_repository_tasks_and_writes_every_rollout(task_file, tiny_dir, tmp_path):
    out, rollouts = tmp_path / "result.json", tmp_path / "rollouts.jsonl"
    args = [
        "eval", tiny_dir, "--env", "feature_deletion", "--task-file", str(task_file),
        "--split", "all", "--samples", "1", "--max-new-tokens", "160", "--no-greedy",
        "--rollouts", str(rollouts), "-o", str(out),
    ]  # fmt: skip
    result = CliRunner().invoke(app, args, env=WIDE)
    assert result.exit_code == 0, result.output

    rows = [json.loads(line) for line in rollouts.read_text().splitlines()]
    assert sorted(row["task_id"] for row in rows) == TASK_IDS  # one row per rollout
    ends = [row["metadata"]["end_reason"] for row in rows]
    assert set(ends) <= {"answer", "truncated"}
    for row in rows:
        assert row["reward"] == 0.0 and row["metadata"]["turns"] == 1
        assert row["metadata"]["tool_calls"] == 0
        assert row["completion_tokens"] == row["sampled_tokens"] <= 160

    data = json.loads(out.read_text())
    assert (data["env"], data["split"], data["n_tasks"]) == ("feature_deletion", "all", 2)
    assert (data["pass@1"], data["mean_reward"], data["greedy_pass@1"]) == (0.0, 0.0, None)
    assert sorted(data["per_task"]) == TASK_IDS
    assert "greedy_per_task" not in data
    agent = data["agent"]
    assert agent["agent/turns_mean"] == 1.0
    assert agent["agent/tool_calls_mean"] == 0.0
    assert agent["agent/parse_failures"] == 0.0 and agent["agent/parse_failure_rate"] == 0.0
    shares = {reason: ends.count(reason) / 2 for reason in ("answer", "truncated")}
    assert agent["agent/end/answer"] == shares["answer"]
    assert agent["agent/end/truncated"] == shares["truncated"]
    assert agent["agent/end/finish"] == 0.0
    tokens = sum(row["prompt_tokens"] + row["completion_tokens"] for row in rows) / 2
    assert agent["agent/episode_tokens_mean"] == tokens

    printed = result.stdout
    assert "feature_deletion all: pass@1 0.000 over 2 tasks x 1 samples (mean reward 0.000)" in (
        printed
    )
    lines = printed.splitlines()
    how = "1 samples/task, T=1, seed 0"

    def table_row(label: str) -> list[str]:
        (line,) = [line for line in lines if line.startswith(f"│ {label} ")]
        return [cell.strip() for cell in line.strip("│┃ ").split("│")]

    assert table_row("turns per episode") == ["turns per episode", "1.000", how]
    assert table_row("tool calls per episode") == ["tool calls per episode", "0.000", how]
    assert table_row("parse failure rate") == ["parse failure rate", "0.000", how]
    expected_ends = ", ".join(f"{k} {v:.2f}" for k, v in shares.items() if v)
    assert table_row("episodes ended by") == ["episodes ended by", "n/a", expected_ends]
    assert table_row("pass@1") == ["pass@1", "0.000", how]
    assert not any("greedy pass@1" in line for line in lines)
    assert f"rollouts: {rollouts}" in printed and f"written: {out}" in printed


@pytest.mark.parametrize(
    "extra",
    [[], ["--repo", "smallkit"]],
    ids=["neither", "both"],
)
def test_feature_deletion_needs_exactly_one_source_of_tasks(tiny_dir, tmp_path, extra):
    task = tmp_path / "tasks.jsonl"
    task.write_text("{}\n")
    args = ["eval", tiny_dir, "--env", "feature_deletion"]
    if extra:
        args += ["--task-file", str(task), *extra]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert _error_lines(result) == [
        "Error: --env feature_deletion needs its tasks: pass --task-file (what datagen wrote) "
        "or --repo (a repository folder, or 'smallkit'), one of them (--debug shows the "
        "traceback)"
    ]
    assert result.stdout == ""


@pytest.mark.parametrize("option", [["--task-file", "TASKS"], ["--repo", "smallkit"]])
def test_task_options_need_the_feature_deletion_environment(tiny_dir, tmp_path, option):
    task = tmp_path / "tasks.jsonl"
    task.write_text("{}\n")
    option = [str(task) if o == "TASKS" else o for o in option]
    result = CliRunner().invoke(app, ["eval", tiny_dir, *option])
    assert result.exit_code == 2
    assert _error_lines(result) == [
        "Error: --task-file and --repo choose feature_deletion tasks; add --env "
        "feature_deletion (--debug shows the traceback)"
    ]


def test_a_missing_task_file_is_refused(tiny_dir, tmp_path):
    missing = tmp_path / "nowhere" / "tasks.jsonl"
    args = ["eval", tiny_dir, "--env", "feature_deletion", "--task-file", str(missing)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert _error_lines(result) == [
        f"Error: --task-file {str(missing)!r} does not exist; pass the file datagen wrote "
        "(--debug shows the traceback)"
    ]


def test_a_greedy_evaluation_writes_each_rollout_once(task_file, tiny_dir, tmp_path):
    rollouts = tmp_path / "rollouts.jsonl"
    args = [
        "eval", tiny_dir, "--env", "feature_deletion", "--task-file", str(task_file),
        "--split", "all", "--samples", "1", "--temperature", "0", "--max-new-tokens", "16",
        "--rollouts", str(rollouts),
    ]  # fmt: skip
    result = CliRunner().invoke(app, args, env=WIDE)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in rollouts.read_text().splitlines()]
    assert sorted(row["task_id"] for row in rows) == TASK_IDS


def test_an_unknown_repository_is_refused_in_one_line(tiny_dir):
    args = ["eval", tiny_dir, "--env", "feature_deletion", "--repo", "no-such-repo"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    (line,) = _error_lines(result)
    assert line.startswith("Error: ") and "'no-such-repo'" in line


def test_eval_takes_the_environment_from_a_run_config(task_file, tiny_dir, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(
        f"""heldout_fraction = 0.5
heldout_salt = "eval-config-test"

[[envs]]
name = "feature_deletion"
options = {{ task_file = "{task_file}", tools = ["read_file", "replace", "finish"], max_turns = 4 }}

[envs.algorithm.sampling]
max_new_tokens = 160
"""
    )
    out = tmp_path / "result.json"
    args = ["eval", tiny_dir, "--config", str(config), "--split", "all", "--samples", "1",
            "--no-greedy", "-o", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args, env=WIDE)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert (data["env"], data["n_tasks"]) == ("feature_deletion", 2)
    both = CliRunner().invoke(app, [*args[:4], "--env", "feature_deletion"])
    assert both.exit_code == 2 and "--config takes the environment" in both.stderr
