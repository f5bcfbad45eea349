"""The zero-advantage filter and time/scoring_s in the native loop, on the tiny model: a
step's zero-advantage groups leave the batch (counted), an all-zero step still trains
as a no-op, and enforce = false keeps them."""

from __future__ import annotations

import sys
from pathlib import Path

from composer_replication.config import RunConfig
from composer_replication.training.loop import train

sys.path.insert(0, str(Path(__file__).parent))
from scripted_env import ScriptedEnv

GROUP_SIZE = 2


class UniformEnv(ScriptedEnv):
    """ScriptedEnv whose groups of the tasks in ``uniform`` get one reward for every rollout
    (zero advantage); the others keep their alternating rewards."""

    def __init__(self, uniform: set[int]) -> None:
        super().__init__(rising=False)
        self.uniform = uniform

    def rollouts(self, policy, tokenizer, task_ids, *, group_size, sampling):
        groups = super().rollouts(
            policy, tokenizer, task_ids, group_size=group_size, sampling=sampling
        )
        if sampling.temperature != 0:  # training calls only
            for i, group in enumerate(groups):
                if i in self.uniform:
                    for rollout in group:
                        rollout.reward = 0.5
        return groups


def _config(tmp_path, tiny_dir, *, enforce: bool = True) -> RunConfig:
    return RunConfig.from_toml(f'''
steps = 1
output_dir = "{tmp_path / "run"}"
[model]
source = "{tiny_dir}"
[model.lora]
r = 4
alpha = 8
[eval]
at_start = false
max_tasks = 1
samples_per_task = 1
temperature = 0
greedy = false
[filters.zero_advantage]
enforce = {str(enforce).lower()}
[[envs]]
name = "scripted"
tasks_per_step = 2
[envs.algorithm.sampling]
group_size = {GROUP_SIZE}
max_new_tokens = 6
[envs.algorithm.advantage]
type = "grpo"
''')


def _row(tmp_path, tiny_dir, uniform, *, enforce=True):
    result = train(
        _config(tmp_path, tiny_dir, enforce=enforce), environments={"scripted": UniformEnv(uniform)}
    )
    (row,) = [r for r in result.metrics if r["step"] == 1]
    return row


def test_zero_advantage_groups_leave_the_batch(tmp_path, tiny_dir):
    row = _row(tmp_path / "on", tiny_dir, {0})
    assert row["rollouts/zero_advantage"] == GROUP_SIZE
    assert row["rollouts/zero_advantage_dropped"] == GROUP_SIZE
    assert row["time/scoring_s"] > 0
    kept = _row(tmp_path / "off", tiny_dir, {0}, enforce=False)
    assert kept["rollouts/zero_advantage"] == GROUP_SIZE
    assert kept["rollouts/zero_advantage_dropped"] == 0
    # the dropped group's sampled tokens are out of the rl component, the other group's in
    assert 0 < row["tokens/rl"] < kept["tokens/rl"]


def test_a_step_of_only_zero_advantage_groups_trains_nothing(tmp_path, tiny_dir):
    row = _row(tmp_path, tiny_dir, {0, 1})
    assert row["rollouts/zero_advantage_dropped"] == 2 * GROUP_SIZE
    assert row["tokens/rl"] == 0 and row["loss"] == 0
