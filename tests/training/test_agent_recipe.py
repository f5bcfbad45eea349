"""The agentic recipe end to end, small: a repository's tasks made on first use (real
datagen gates and reference agent, real sandbox), a warm start on the reference agent's
episodes, then composer on the policy's own episodes (the tiny model), held-out evaluation
before and after, the agent metrics, saved rollouts and the report's agent plots."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from composer_replication.config import RunConfig
from composer_replication.training.loop import train

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FD_REPO = Path(__file__).resolve().parents[1] / "fixtures" / "fd_repo"
OPTIONS = {
    "repo": None,  # set per test: a copy of the fixture repository
    "max_tasks": 4,
    "tools": ["read_file", "replace", "run_tests", "finish"],
    "reference_reads": False,
    "max_turns": 4,
    "max_observation_chars": 1500,
}


def _recipe(shared_dir, tiny_dir, options: dict) -> RunConfig:
    """The recipe in two steps: one of imitating the reference agent, one of composer."""
    return RunConfig.model_validate(
        {
            "steps": 2,
            "output_dir": str(shared_dir / "run"),
            "heldout_fraction": 0.5,
            "heldout_salt": "agent-recipe-test-1",
            "save_rollouts": "all",
            "model": {"source": tiny_dir, "lora": {"r": 4, "alpha": 8}},
            "optim": {"lr": 1e-3},
            "eval": {"every": 2, "samples_per_task": 1, "temperature": 0.0, "greedy": False},
            "envs": [
                {
                    "name": "feature_deletion",
                    "tasks_per_step": 2,
                    "last_step": 1,
                    "options": options,
                    "algorithm": {
                        "sampling": {"source": "reference", "max_new_tokens": 160},
                        "advantage": {"type": "sft"},
                    },
                },
                {
                    "name": "feature_deletion",
                    "tasks_per_step": 1,
                    "first_step": 2,
                    "options": options,
                    "algorithm": {
                        "sampling": {"group_size": 2, "temperature": 1.0, "max_new_tokens": 160},
                        "advantage": {"type": "composer", "beta_replay": 0.0},
                    },
                },
            ],
        }
    )


def test_warm_start_then_composer_on_a_repository(shared_dir, tiny_dir, monkeypatch):
    monkeypatch.setenv("COMPOSER_REPLICATION_CACHE", str(shared_dir / "cache"))
    repo = shared_dir / "fd_repo"
    shutil.copytree(FD_REPO, repo, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    options = dict(OPTIONS, repo=str(repo))
    config = _recipe(shared_dir, tiny_dir, options)
    result = train(config)
    assert result.steps == 2
    rows = {row["step"]: row for row in result.metrics}
    # step 1: the reference agent's episodes imitated, nothing sampled
    assert rows[1]["rollouts/demonstrations"] == 2.0 and rows[1]["loss/ce"] > 0
    assert rows[1]["rollouts/count"] == 0.0
    # step 2: the policy's own episodes (the tiny model calls no tool) with agent metrics
    assert rows[2]["rollouts/count"] == 2.0
    assert rows[2]["agent/turns_mean"] >= 1.0
    assert rows[2]["agent/end/answer"] + rows[2]["agent/end/truncated"] == 1.0
    for step in (0, 2):  # held-out evaluations, before and after
        assert rows[step]["heldout/pass@1"] == 0.0
        assert rows[step]["heldout/agent/turns_mean"] >= 1.0
    run = Path(result.run_dir)
    saved = sorted(p.name for p in (run / "rollouts").iterdir())
    assert saved == [
        "eval_step_0000.jsonl", "eval_step_0002.jsonl",
        "train_step_0001.jsonl", "train_step_0002.jsonl",
    ]  # fmt: skip
    demo = json.loads((run / "rollouts" / "train_step_0002.jsonl").read_text().splitlines()[0])
    assert demo["metadata"]["end_reason"] in ("answer", "truncated")
    assert (run / "report" / "agent.png").is_file()
    # the tasks were made once, into the cache, and a second run reuses them
    made = list((shared_dir / "cache" / "tasks").glob("fd_repo-*/tasks.jsonl"))
    assert len(made) == 1
    tasks = [json.loads(line) for line in made[0].read_text().splitlines()]
    assert all(t["reference_cost"]["turns"] <= 4 for t in tasks)


def test_warm_start_on_bug_fix_tasks_then_composer(shared_dir, tiny_dir, monkeypatch):
    """The same recipe on bug-fix tasks (``kind = "bugs"``) as agent_bugs.toml runs it: the
    statement shows the function the failing tests point at, the demonstrations rewrite it
    with replace_function, run the tests and finish; the held-out tasks are bugs of
    functions the training never saw."""
    monkeypatch.setenv("COMPOSER_REPLICATION_CACHE", str(shared_dir / "cache"))
    repo = shared_dir / "fd_repo"
    shutil.copytree(FD_REPO, repo, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    options = dict(
        OPTIONS,
        repo=str(repo),
        kind="bugs",
        bugs_per_function=1,
        max_tasks=6,
        tools=["replace_function", "run_tests", "finish"],
        max_turns=3,
    )
    del options["reference_reads"]  # the default follows the tools
    config = _recipe(shared_dir, tiny_dir, options)
    result = train(config)
    rows = {row["step"]: row for row in result.metrics}
    assert rows[1]["rollouts/demonstrations"] == 2.0 and rows[1]["loss/ce"] > 0
    assert rows[2]["rollouts/count"] == 2.0
    (made,) = (shared_dir / "cache" / "tasks").glob("fd_repo-bugs-*/tasks.jsonl")
    tasks = [json.loads(line) for line in made.read_text().splitlines()]
    assert tasks and all(t["kind"] == "bug" and "#bug:" in t["task_id"] for t in tasks)
    assert all(t["prompt"].startswith("Tests of this repository fail") for t in tasks)
    # the demonstration's calls: rewrite the function the statement shows, run the tests,
    # finish (the reference edits and reads follow the tools)
    from composer_replication.envs.feature_deletion import FeatureDeletionEnv

    env = FeatureDeletionEnv(made, tools=options["tools"])
    for task in tasks:
        assert "```python\n" in task["prompt"]
        calls = env.reference_episode(task["task_id"])
        assert [name for name, _ in calls] == ["replace_function", "run_tests", "finish"]
        assert calls[0][1]["path"] == task["file"]
        assert calls[0][1]["name"].rsplit(".", 1)[-1] in task["prompt"]
