"""``reward``: REINFORCE with the raw reward as the advantage (no baseline).

Useful with groups of one, where a group-relative baseline is 0. Component: ``rl``.
"""

from __future__ import annotations

import math

from composer_replication.algo.base import Algorithm, check_group, rollout_to_sample, sampled
from composer_replication.rollout.types import Rollout
from composer_replication.wire import TrainingSample


class RewardAlgorithm(Algorithm):
    """``A = r`` on every sampled token."""

    name = "reward"
    components = ("rl",)

    def assign(self, group: list[Rollout]) -> list[TrainingSample]:
        check_group(group, self.name)
        samples = []
        for rollout in group:
            if not math.isfinite(rollout.reward):
                raise ValueError(
                    f"rollout {rollout.task_id!r}: reward {rollout.reward} is not finite"
                )
            sample = rollout_to_sample(rollout, source=self.name)
            sample.advantages = sampled(rollout, rollout.reward)
            samples.append(sample)
        return samples
