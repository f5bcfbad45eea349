"""``opd``: on-policy distillation from a frozen teacher (reverse KL on the policy's samples).

The policy samples; at ship time a frozen teacher (an OpenAI-compatible endpoint or a
local model) prefills each sample and reports the log-prob of every sampled token. The
trainer's ``ref_kl`` component then pushes the policy's log-prob towards the teacher's
(per-token reverse KL as the policy-gradient signal; GKD, arXiv 2306.13649). There is no
scalar advantage: ``rl_weights`` are zeros and ``advantages`` None. Teacher and policy must
share the tokenizer (the teacher scores the policy's token ids).
"""

from __future__ import annotations

from typing import Any

from composer_replication.algo.base import (
    REF_CONTEXT,
    REF_INDEX,
    Algorithm,
    FrozenPool,
    fill_ref_logprobs,
    sampled,
    zeros,
)
from composer_replication.algo.scoring import PrefillScorer
from composer_replication.config.advantage import OPDAdvantage
from composer_replication.samples.rollouts import Rollout
from composer_replication.samples.wire import TrainingSample


class OPDAlgorithm(Algorithm):
    """ref_kl on sampled tokens against a frozen teacher's prefill log-probs."""

    config_class = OPDAdvantage
    frozen_pools = (
        FrozenPool(
            "teacher",
            given_as="scorer",
            model_field="model",
            error_if_missing="opd needs scorer=: a PrefillScorer for the frozen teacher "
            "(EndpointPrefillScorer(base_url, name) or LocalPrefillScorer(model))",
        ),
    )

    def __init__(self, config: Any, scorer: PrefillScorer | None = None) -> None:
        super().__init__(config)
        if scorer is not None:
            self.connect_frozen_pool("teacher", scorer)

    @property
    def scorer(self) -> PrefillScorer:
        """The frozen teacher's pool."""
        return self.frozen_pool("teacher")

    def build_samples(self, rollout: Rollout) -> list[TrainingSample]:
        """The plain sample with ref_kl weight 1 on its sampled tokens and a pending teacher
        request over its own ids (no rl)."""
        samples = super().build_samples(rollout)
        for sample in samples:
            sample.rl_weights = zeros(sample)
            sample.ref_kl_weights = sampled(rollout, 1.0)
            if any(sample.ref_kl_weights):
                n_prompt = len(rollout.prompt_ids)
                sample.metadata[REF_CONTEXT] = list(sample.input_ids)
                sample.metadata[REF_INDEX] = [-1] * n_prompt + list(
                    range(n_prompt, sample.n_tokens)
                )
            else:
                sample.ref_logprobs = zeros(sample)
        return samples

    async def score_samples(self, samples: list[TrainingSample]) -> None:
        """Teacher prefill log-probs of the sampled tokens -> ``ref_logprobs``."""
        await fill_ref_logprobs(samples, self.scorer)
