"""benchmarks/gpu.py: its pure parts (GPU busy from kernel intervals, synthetic rewards, the
goals table) with hand-made inputs, and its CPU dry run, which writes every goal row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _gpu_goals as goals  # noqa: E402
from _gpu_goals import (  # noqa: E402
    PartBudget,
    busy_share,
    evaluate_goals,
    goals_table,
    synthetic_group_rewards,
    synthetic_reward,
    union_length,
)
from composer_replication.algo.advantage import grpo_advantages  # noqa: E402

# ------------------------------------------------------------------ kernel interval union


def test_union_of_disjoint_intervals_is_their_sum():
    assert union_length([(0.0, 2.0), (5.0, 6.0)]) == 3.0


def test_overlapping_nested_and_touching_intervals_count_once():
    # [0, 4] and [3, 6] overlap -> [0, 6]; [1, 2] is inside; [6, 7] touches; [10, 10] is empty
    intervals = [(3.0, 6.0), (1.0, 2.0), (10.0, 10.0), (0.0, 4.0), (6.0, 7.0)]
    assert union_length(intervals) == 7.0


def test_two_streams_running_at_once_never_exceed_the_wall():
    # the same 8 us of wall time covered by two streams' kernels: busy 80% of 10 us, not 160%
    stream_a = [(0.0, 4.0), (4.0, 8.0)]
    stream_b = [(1.0, 3.0), (2.0, 7.0)]
    assert busy_share(stream_a + stream_b, 10.0) == pytest.approx(0.8)


def test_union_of_nothing_is_zero():
    assert union_length([]) == 0.0
    assert busy_share([], 5.0) == 0.0


def test_bad_intervals_and_walls_are_refused():
    with pytest.raises(ValueError, match="ends before it starts"):
        union_length([(2.0, 1.0)])
    with pytest.raises(ValueError, match="not finite"):
        union_length([(0.0, float("nan"))])
    with pytest.raises(ValueError, match="wall time 0"):
        busy_share([(0.0, 1.0)], 0)


# ------------------------------------------------------------------ synthetic rewards


def test_synthetic_rewards_are_deterministic_and_in_the_unit_interval():
    completions = [[5, 6, 7], [5, 6, 7], [9], []]
    first = synthetic_group_rewards(0, "task-a", completions)
    assert first == synthetic_group_rewards(0, "task-a", completions)
    assert all(0.0 <= r < 1.0 for r in first)
    # the row takes part: identical completions of one group still score differently
    assert first[0] != first[1]
    # the value is the documented hash: blake2b(seed, row, task, tokens) / 2**64
    assert first[2] == synthetic_reward(0, "task-a", 2, [9])


def test_synthetic_rewards_depend_on_seed_task_and_tokens():
    base = synthetic_reward(0, "task-a", 0, [1, 2, 3])
    assert synthetic_reward(1, "task-a", 0, [1, 2, 3]) != base
    assert synthetic_reward(0, "task-b", 0, [1, 2, 3]) != base
    assert synthetic_reward(0, "task-a", 0, [1, 2, 4]) != base


def test_synthetic_rewards_give_every_group_non_zero_advantages():
    for task in ("a", "b", "c"):
        rewards = synthetic_group_rewards(7, task, [[t, t + 1] for t in range(8)])
        advantages = grpo_advantages(rewards)
        assert advantages.abs().sum() > 0
        assert advantages.sum().abs() < 1e-5  # Dr.GRPO: reward minus the group mean


def test_a_group_whose_hashes_agree_is_still_varied(monkeypatch):
    monkeypatch.setattr(goals, "synthetic_reward", lambda *args: 0.25)
    assert synthetic_group_rewards(0, "t", [[1], [2], [3]]) == [0.75, 0.25, 0.25]
    monkeypatch.setattr(goals, "synthetic_reward", lambda *args: 0.5)
    assert synthetic_group_rewards(0, "t", [[1], [2]]) == [0.0, 0.5]
    assert synthetic_group_rewards(0, "t", [[1]]) == [0.5]  # one row: nothing to vary


def test_part_budget_allows_a_repeat_only_while_it_fits():
    now = [100.0]
    budget = PartBudget(10.0, clock=lambda: now[0])
    now[0] = 104.0
    assert budget.used() == 4.0 and budget.left() == 6.0
    assert budget.allows(6.0) and not budget.allows(6.5)


# ------------------------------------------------------------------ goals table


def measured_results() -> dict:
    """A GPU run's results, made up: three goals met, two not, one unavailable."""
    return {
        "measured": True,
        "sampling": {
            "goal_batch": 64,
            "batch_64": {"hf": {"tokens_s": 2000.0}, "static_graphs": {"tokens_s": 24000.0}},
        },
        "train": {
            "plain": {"tokens_s": 100_000.0},
            "rl": {"tokens_s": 110_000.0},
            "composer": {
                "tokens_s": 44_000.0,
                "component_tokens": {"rl": 70_000.0, "jsd": 30_000.0, "dpo": 16.0},
            },
        },
        "steps": {
            "composer": {
                "async_0": {
                    "gpu_busy_kernels": 0.62,
                    "gpu_busy_nvml": 0.97,
                    "sample_s": 3.0,
                    "grade_score_s": 1.0,
                    "train_s": 5.0,
                    "step_s": 9.0,
                },
                "async_1": {"unavailable": "inference.async_level=1 needs engine = 'vllm'"},
            }
        },
        "memory": {"peak_bytes": {"sample": 30e9, "grade": 20e9, "train": 60e9}},
    }


def test_goal_rows_of_a_measured_run():
    rows = {r["key"]: r for r in evaluate_goals(measured_results())}
    assert list(rows) == [
        "gpu_busy",
        "async_overlap",
        "rl_learner",
        "composer_learner",
        "sampling",
        "memory",
    ]
    assert rows["gpu_busy"]["status"] == "met"
    assert rows["gpu_busy"]["shown"] == "62%"
    assert rows["gpu_busy"]["detail"] == "NVML utilisation over the same step: 97%"
    assert rows["async_overlap"]["status"] == "not available in this build"
    assert rows["async_overlap"]["value"] is None
    assert rows["rl_learner"]["value"] == pytest.approx(1.1)
    assert rows["rl_learner"]["status"] == "met"
    assert rows["composer_learner"]["value"] == pytest.approx(0.4)
    assert rows["composer_learner"]["status"] == "not met"
    assert "dpo 16, jsd 30,000, rl 70,000" in rows["composer_learner"]["detail"]
    assert rows["sampling"]["shown"] == "12.0x" and rows["sampling"]["status"] == "met"
    # 60 GB of 80: 25% spare
    assert rows["memory"]["value"] == pytest.approx(0.25)
    assert rows["memory"]["shown"] == "60.0 GB (25% spare)"
    assert rows["memory"]["status"] == "met"


def test_async_goal_compares_the_step_with_the_slower_phase():
    results = measured_results()
    results["steps"]["composer"]["async_1"] = {"step_s": 6.0}
    row = evaluate_goals(results)[1]
    # max(3 + 1, 5) = 5 s; 6 / 5 = 1.2 > 1.15
    assert row["value"] == pytest.approx(1.2)
    assert row["status"] == "not met"
    results["steps"]["composer"]["async_1"] = {"step_s": 5.5}
    assert evaluate_goals(results)[1]["status"] == "met"


def test_missing_and_failed_parts_say_why():
    results = measured_results()
    del results["sampling"]
    results["train"]["rl"] = {"error": "RuntimeError: out of memory"}
    rows = {r["key"]: r for r in evaluate_goals(results)}
    assert rows["sampling"]["status"] == "not measured"
    assert rows["sampling"]["detail"] == "no sampling in the results"
    assert rows["rl_learner"]["status"] == "not measured"
    assert rows["rl_learner"]["detail"] == "train.rl failed: RuntimeError: out of memory"


def test_a_cpu_run_shows_values_but_gives_no_verdict():
    results = measured_results()
    results["measured"] = False
    results["dry_run"] = "on CPU"
    rows = {r["key"]: r for r in evaluate_goals(results)}
    assert rows["gpu_busy"]["status"] == "not measured on CPU (dry run: 62%)"
    assert not any(r["measured"] for r in rows.values())
    table = goals_table(list(rows.values()))
    assert table.splitlines()[0] == "| goal | target | result | status | detail |"
    assert (
        "| composer step: GPU busy (kernel union) | >= 60% | - | not measured on CPU "
        "(dry run: 62%) | NVML utilisation over the same step: 97% |"
    ) in table


def test_goals_table_of_a_measured_run():
    table = goals_table(evaluate_goals(measured_results()))
    assert (
        "| rl-only learner vs plain forward + backward + fused AdamW | >= 1.05x | 1.10x | met |"
        in (table)
    )
    assert "| step at async_level = 1 vs max(sample + grade, train) | <= 1.15x | - | " in table
    assert len(table.splitlines()) == 2 + len(goals.GOALS)


# ------------------------------------------------------------------ the CPU dry run


@pytest.mark.slow
def test_gpu_benchmark_all_dry_run_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/gpu.py"),
            "--all",
            "--device",
            "cpu",
            "--quick",
            "--heldout",
            "0.05",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "gpu.json").read_text())
    rows = {r["key"]: r for r in results["goals"]}
    assert list(rows) == [g.key for g in goals.GOALS]
    for key, row in rows.items():
        assert row["measured"] is False, key
        assert row["status"].startswith("not measured on CPU"), row
    # the parts ran: dry-run values are shown where the CPU has them
    for key in ("async_overlap", "rl_learner", "composer_learner", "sampling"):
        assert "(dry run: " in rows[key]["status"], rows[key]
    assert results["sampling"]["batch_4"]["static_graphs"]["tokens_s"] > 0
    # every loss component trains: synthetic rewards give random weights advantages
    composer = results["train"]["composer"]["component_tokens"]
    assert composer["rl"] > 0 and composer["jsd"] > 0 and composer["dpo"] > 0, composer
    assert results["train"]["rl"]["component_tokens"]["jsd"] == 0
    step = results["steps"]["composer"]["async_0"]
    assert step["component_tokens"]["rl"] > 0 and step["sample_s"] > 0, step
    assert step["gpu_busy_kernels"] is None and step["peak_bytes"]["train"] is None
    ahead = results["steps"]["composer"]["async_1"]
    assert "step_s" in ahead or "unavailable" in ahead, ahead
    assert results["heldout"]["composer"]["steps"] >= 1
    markdown = (out / "gpu.md").read_text()
    for heading in ("Sampling, kept tokens/s", "Training, tokens/s", "Seconds per step", "Goals:"):
        assert heading in markdown
    assert "rl-only learner vs plain forward" in proc.stdout
