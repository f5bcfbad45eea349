"""``grpo``: Dr.GRPO (arXiv 2503.20783), the default algorithm; classic GRPO opt-in.

Per group: rewards, optionally minus a length penalty, become group-relative advantages
(``grpo_advantages``); each rollout's advantage is put on its sampled tokens. Component:
``rl`` with weight 1 on every trainable token (no ``rl_weights`` stream).
"""

from __future__ import annotations

from composer_replication.algo.advantage import grpo_advantages, length_penalty
from composer_replication.algo.base import Algorithm, credited, one_per_rollout
from composer_replication.config.advantage import GRPOAdvantage
from composer_replication.samples.rollouts import Rollout
from composer_replication.samples.wire import TrainingSample


class GRPOAlgorithm(Algorithm):
    """Group-relative advantages on sampled tokens."""

    config_class = GRPOAdvantage

    def group_advantages(self, group: list[Rollout]) -> list[float]:
        """One advantage per rollout (penalised rewards, then ``grpo_advantages``)."""
        cfg = self.advantage_config
        rewards = [r.reward for r in group]
        if cfg.length_penalty:
            penalty = length_penalty(
                [r.n_sampled_tokens for r in group],
                coefficient=cfg.length_penalty,
                target=cfg.length_target,
            )
            rewards = [r - float(p) for r, p in zip(rewards, penalty)]
        return grpo_advantages(rewards, std_normalize=cfg.std_normalize, eps=cfg.eps).tolist()

    def finalize_group(
        self, group: list[Rollout], samples: list[TrainingSample]
    ) -> list[TrainingSample]:
        cfg = self.advantage_config
        pairs = one_per_rollout(group, samples)
        for (rollout, sample), advantage in zip(pairs, self.group_advantages(group)):
            sample.advantages = credited(rollout, advantage, cfg.turn_reward_weight)
        return samples
