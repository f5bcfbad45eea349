"""A user's algorithm that overrides only the hooks trains through the real loop: the loop
drives its stages (process_group per group, score per batch) and its samples are what the
learner steps on."""

from __future__ import annotations

import sys
from pathlib import Path

from composer_replication.algo import Algorithm
from composer_replication.algo.base import one_per_rollout, sampled
from composer_replication.config import RunConfig
from composer_replication.trainer.loop import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from scripted_env import ScriptedEnv

STEPS, TASKS_PER_STEP, GROUP_SIZE = 2, 2, 3


class LeaveOneOut(Algorithm):
    """RLOO (arXiv 2402.14740): each rollout's baseline is the mean reward of its siblings.

    A user's algorithm outside the registry; it reads the ``reward`` type's config, which has
    no settings of its own. It records the hooks the loop drives."""

    name = "reward"
    components = ("rl",)

    def __init__(self, config):
        super().__init__(config)
        self.calls: list[str] = []

    def finalize_group(self, group, samples):
        self.calls.append("finalize_group")
        rewards = [r.reward for r in group]
        for rollout, sample in one_per_rollout(group, samples):
            baseline = (sum(rewards) - rollout.reward) / (len(rewards) - 1)
            sample.advantages = sampled(rollout, rollout.reward - baseline)
        return samples

    async def score_samples(self, samples):
        self.calls.append("score_samples")
        for sample in samples:
            sample.metadata["scored"] = True


def _config(tmp_path, tiny_dir) -> RunConfig:
    return RunConfig.from_toml(f'''
steps = {STEPS}
output_dir = "{tmp_path / "run"}"
[model]
source = "{tiny_dir}"
[model.lora]
r = 4
alpha = 8
[eval]
at_start = false
every = {STEPS}
max_tasks = 1
samples_per_task = 1
temperature = 0
[[envs]]
name = "scripted"
tasks_per_step = {TASKS_PER_STEP}
[envs.algorithm.sampling]
group_size = {GROUP_SIZE}
max_new_tokens = 6
[envs.algorithm.advantage]
type = "reward"
''')


def test_a_user_algorithm_trains_through_the_loop(tmp_path, tiny_dir):
    config = _config(tmp_path, tiny_dir)
    # rewards 0.5, 0.0, 0.5 in every group: RLOO advantages 0.25, -0.5, 0.25 (by reward)
    trainer = Trainer(config, environments={"scripted": ScriptedEnv(rising=False)})
    algo = LeaveOneOut(config.envs[0].algorithm)
    trainer.runtimes[0].algorithm = algo
    trained = []
    real_update = trainer.learner.update

    def recording_update(batches, step):
        trained.append([s for b in batches for s in b.samples])
        return real_update(batches, step)

    trainer.learner.update = recording_update
    result = trainer.run()

    assert result.steps == STEPS
    # per step: one group stage per task, then one ship-time call (the batch fits one chunk)
    assert algo.calls == (["finalize_group"] * TASKS_PER_STEP + ["score_samples"]) * STEPS
    assert [len(samples) for samples in trained] == [TASKS_PER_STEP * GROUP_SIZE] * STEPS
    for samples in trained:
        for sample in samples:
            expected = {0.5: 0.25, 0.0: -0.5}[sample.metadata["reward"]]
            live = {a for a, m in zip(sample.advantages, sample.loss_mask) if m}
            assert live == ({expected} if any(sample.loss_mask) else set())
            assert sample.source == "reward" and sample.metadata["scored"] is True
    rows = [r for r in result.metrics if "tokens/rl" in r]
    assert len(rows) == STEPS and all(r["tokens/rl"] > 0 for r in rows)
