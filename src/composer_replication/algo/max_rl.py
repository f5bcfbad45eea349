"""``max_rl``: MaxRL (arXiv 2602.02710), advantages normalised by the group's mean reward.

``A = (r - mean) / (mean + eps)``, 0 for a group with ``mean <= 0``; put on sampled tokens.
Component: ``rl``.
"""

from __future__ import annotations

from composer_replication.algo.advantage import max_rl_advantages
from composer_replication.algo.base import Algorithm, check_group, rollout_to_sample, sampled
from composer_replication.rollout.types import Rollout
from composer_replication.wire import TrainingSample


class MaxRLAlgorithm(Algorithm):
    """Mean-normalised group advantages on sampled tokens."""

    name = "max_rl"
    components = ("rl",)

    def assign(self, group: list[Rollout]) -> list[TrainingSample]:
        check_group(group, self.name)
        advantages = max_rl_advantages([r.reward for r in group], eps=self.advantage_config.eps)
        samples = []
        for rollout, advantage in zip(group, advantages.tolist()):
            sample = rollout_to_sample(rollout, source=self.name)
            sample.advantages = sampled(rollout, advantage)
            samples.append(sample)
        return samples
