"""``reward``: REINFORCE with the raw reward as the advantage (no baseline).

Useful with groups of one, where a group-relative baseline is 0. Component: ``rl``.
"""

from __future__ import annotations

import math

from composer_replication.algo.base import Algorithm, sampled
from composer_replication.config.advantage import RewardAdvantage
from composer_replication.samples.rollouts import Rollout
from composer_replication.samples.wire import TrainingSample


class RewardAlgorithm(Algorithm):
    """``A = r`` on every sampled token."""

    config_class = RewardAdvantage

    def build_samples(self, rollout: Rollout) -> list[TrainingSample]:
        """The plain sample with ``A = r`` on its sampled tokens (no group baseline)."""
        if not math.isfinite(rollout.reward):
            raise ValueError(f"rollout {rollout.task_id!r}: reward {rollout.reward} is not finite")
        samples = super().build_samples(rollout)
        for sample in samples:
            sample.advantages = sampled(rollout, rollout.reward)
        return samples
