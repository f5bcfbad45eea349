"""``sft``: cross-entropy on tokens sampled from a frozen source (teacher distillation).

A frozen model (``sampling.source``, never ``"policy"``) generates; the policy imitates it
with ``ce`` weight ``ce_weight`` on every sampled token. ``rl_weights`` are zeros and
``advantages`` None: the sampler's log-probs are the teacher's, not the policy's.
"""

from __future__ import annotations

from composer_replication.algo.base import (
    Algorithm,
    check_group,
    rollout_to_sample,
    sampled,
    zeros,
)
from composer_replication.rollout.types import Rollout
from composer_replication.wire import TrainingSample


class SFTAlgorithm(Algorithm):
    """ce on the frozen source's sampled tokens."""

    name = "sft"
    components = ("ce",)

    def assign(self, group: list[Rollout]) -> list[TrainingSample]:
        check_group(group, self.name)
        samples = []
        for rollout in group:
            sample = rollout_to_sample(rollout, source=self.name)
            sample.rl_weights = zeros(sample)
            sample.ce_weights = sampled(rollout, self.advantage_config.ce_weight)
            samples.append(sample)
        return samples
