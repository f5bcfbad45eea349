"""``echo``: Dr.GRPO on the policy's actions + weighted CE on environment observations.

In multi-turn tool use the completion interleaves sampled tokens (actions) with tokens the
environment wrote (tool output, user turns). Besides ``rl`` credit on the actions, echo
trains the policy to predict the observations with ``ce``, weighted per message role
(``roles.<role>.alpha``; tool bodies 0.1 by default): a world-model signal that needs no
reward. An optional filter ``fn(rollout) -> bool`` drops a rollout's observations from
``ce`` (its rl credit stays). Observation roles come from ``rollout.token_roles``; without
them no observation is weighted.
"""

from __future__ import annotations

from typing import Any

from composer_replication.algo.advantage import grpo_advantages
from composer_replication.algo.base import (
    Algorithm,
    check_group,
    load_callable,
    on_completion,
    rollout_to_sample,
    sampled,
)
from composer_replication.rollout.types import Rollout
from composer_replication.wire import TrainingSample


class EchoAlgorithm(Algorithm):
    """rl on sampled tokens + ce on observation tokens, per role."""

    name = "echo"
    components = ("rl", "ce")

    def __init__(self, config: Any, filter_fn: Any = None) -> None:
        super().__init__(config)
        path = self.advantage_config.filter
        self.filter_fn = filter_fn or (load_callable(path, "echo filter") if path else None)

    def observation_weights(self, rollout: Rollout) -> list[float]:
        """Per completion token: the role's alpha on observation tokens, 0.0 elsewhere."""
        n = len(rollout.completion_ids)
        if rollout.token_roles is None or (
            self.filter_fn is not None and not self.filter_fn(rollout)
        ):
            return [0.0] * n
        roles = self.advantage_config.roles
        return [
            0.0 if m or role not in roles else float(roles[role].alpha)
            for m, role in zip(rollout.completion_mask or (), rollout.token_roles)
        ]

    def assign(self, group: list[Rollout]) -> list[TrainingSample]:
        check_group(group, self.name)
        advantages = grpo_advantages([r.reward for r in group]).tolist()
        samples = []
        for rollout, advantage in zip(group, advantages):
            sample = rollout_to_sample(rollout, source=self.name)
            sample.advantages = sampled(rollout, advantage)
            weights = self.observation_weights(rollout)
            if any(weights):
                sample.ce_weights = on_completion(rollout, weights)
            samples.append(sample)
        return samples
