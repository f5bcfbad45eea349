"""``max_rl``: MaxRL (arXiv 2602.02710), advantages normalised by the group's mean reward.

``A = (r - mean) / (mean + eps)``, 0 for a group with ``mean <= 0``; put on sampled tokens.
Component: ``rl``.
"""

from __future__ import annotations

from composer_replication.algo.advantage import max_rl_advantages
from composer_replication.algo.base import Algorithm, credited, one_per_rollout
from composer_replication.config.advantage import MaxRLAdvantage
from composer_replication.samples.rollouts import Rollout
from composer_replication.samples.wire import TrainingSample


class MaxRLAlgorithm(Algorithm):
    """Mean-normalised group advantages on sampled tokens."""

    config_class = MaxRLAdvantage

    def finalize_group(
        self, group: list[Rollout], samples: list[TrainingSample]
    ) -> list[TrainingSample]:
        cfg = self.advantage_config
        advantages = max_rl_advantages([r.reward for r in group], eps=cfg.eps)
        for (rollout, sample), advantage in zip(
            one_per_rollout(group, samples), advantages.tolist()
        ):
            sample.advantages = credited(rollout, advantage, cfg.turn_reward_weight)
        return samples
