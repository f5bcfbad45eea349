"""A loss term added in one module: token-level unlikelihood (Welleck et al., arXiv
1908.04319), ``-sum_t w_t log(1 - p(x_t))`` over the tokens an algorithm marks.

Declaring the component is all the trainer needs: the packer builds its stream, the step
counts its tokens, normalises its sum by that count, scales it by
``[loss] coefficients.unlikelihood`` and reports ``loss/unlikelihood`` and
``tokens/unlikelihood``. The algorithm below stamps the stream: it pushes down the tokens of
failed rollouts (``type = "examples.unlikelihood_term:UnlikelihoodOnFailures"``).
"""

from __future__ import annotations

import torch
from pydantic import Field

from composer_replication.algo import Algorithm
from composer_replication.algo.base import one_per_rollout, sampled
from composer_replication.config.advantage import UserAdvantage
from composer_replication.config.components import LossComponent, register_component

UNLIKELIHOOD = register_component(
    LossComponent(
        name="unlikelihood",
        stream="unlikelihood_weights",
        counts="weighted",
        compute=f"{__name__}:unlikelihood_term",
    )
)


def unlikelihood_term(inputs):
    """The component's sum over a micro-batch (None when no row carries its stream)."""
    weights = inputs.mb.stream(UNLIKELIHOOD.stream)
    if inputs.logprobs is None or weights is None:
        return None
    w = weights[:, 1:].to(inputs.logprobs.dtype)
    # log(1 - p) = log(-expm1(log p)); clamp keeps p = 1 finite
    per_token = -torch.log(-torch.expm1(inputs.logprobs.clamp(max=-1e-6)))
    return (per_token * w).sum()


class UnlikelihoodAdvantage(UserAdvantage):
    """The algorithm's declarations and options."""

    trains = ("unlikelihood",)
    below: float = Field(1.0, description="A rollout whose reward is below this failed.")


class UnlikelihoodOnFailures(Algorithm):
    """Unlikelihood on every sampled token of a failed rollout; no rl credit."""

    config_class = UnlikelihoodAdvantage

    def finalize_group(self, group, samples):
        for rollout, sample in one_per_rollout(group, samples):
            failed = rollout.reward < self.advantage_config.below
            sample.weights[UNLIKELIHOOD.stream] = sampled(rollout, 1.0 if failed else 0.0)
            sample.rl_weights = [0.0] * sample.n_tokens
            sample.advantages = None
        return samples
