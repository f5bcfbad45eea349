"""A user's algorithm, as a user writes one: this module alone, named in a run config by
import path (``type = "example_user_algorithm:LeaveOneOut"``).

RLOO (arXiv 2402.14740): each rollout's baseline is the mean reward of its siblings. It
records the stages the loop drives, so a test can check them.
"""

from __future__ import annotations

from pydantic import Field

from composer_replication.algo import Algorithm
from composer_replication.algo.base import one_per_rollout, sampled
from composer_replication.config.advantage import UserAdvantage


class LeaveOneOutAdvantage(UserAdvantage):
    """What the algorithm trains, and its options (the advantage table's other keys)."""

    trains = ("rl",)
    group_relative = True
    scale: float = Field(1.0, gt=0, description="Multiplier of every advantage.")


class LeaveOneOut(Algorithm):
    """``A = scale * (r - mean of the siblings' rewards)`` on the sampled tokens."""

    config_class = LeaveOneOutAdvantage

    def __init__(self, config) -> None:
        super().__init__(config)
        self.calls: list[str] = []

    def finalize_group(self, group, samples):
        self.calls.append("finalize_group")
        scale = self.advantage_config.scale
        rewards = [r.reward for r in group]
        for rollout, sample in one_per_rollout(group, samples):
            baseline = (sum(rewards) - rollout.reward) / (len(rewards) - 1)
            sample.advantages = sampled(rollout, scale * (rollout.reward - baseline))
        return samples

    async def score_samples(self, samples):
        self.calls.append("score_samples")
        for sample in samples:
            sample.metadata["scored"] = True
