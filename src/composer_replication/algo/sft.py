"""``sft``: cross-entropy on tokens sampled from a frozen source (teacher distillation).

A frozen model (``sampling.source``, never ``"policy"``) generates; the policy imitates it
with ``ce`` weight ``ce_weight`` on every sampled token. ``rl_weights`` are zeros and
``advantages`` None: the sampler's log-probs are the teacher's, not the policy's.
"""

from __future__ import annotations

from composer_replication.algo.base import Algorithm, sampled, zeros
from composer_replication.config.advantage import SFTAdvantage
from composer_replication.samples.rollouts import Rollout
from composer_replication.samples.wire import TrainingSample


class SFTAlgorithm(Algorithm):
    """ce on the frozen source's sampled tokens."""

    config_class = SFTAdvantage

    def build_samples(self, rollout: Rollout) -> list[TrainingSample]:
        """The plain sample with ce ``ce_weight`` on its sampled tokens and no rl."""
        samples = super().build_samples(rollout)
        for sample in samples:
            sample.rl_weights = zeros(sample)
            sample.ce_weights = sampled(rollout, self.advantage_config.ce_weight)
        return samples
