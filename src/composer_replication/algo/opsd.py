"""``opsd``: on-policy self-distillation behind a demonstration (the SDFT setting).

The policy samples on the plain prompt. The reference (by default the live policy itself)
scores the same completion behind a demonstration block: the rollout's last user message
rewritten by ``demo_template`` with a better sibling's completion, or, when no sibling did
better, with ``rollout.metadata["reference"]`` (a provided reference solution). The
trainer's ``ref_kl`` component pulls the plain-context policy towards its demo-conditioned
self. A rollout with no demonstration gets no signal (all-zero weights).

``rl_weights`` are zeros and ``advantages`` None.
"""

from __future__ import annotations

from typing import Any

from composer_replication.algo.base import (
    REF_CONTEXT,
    REF_INDEX,
    Algorithm,
    AlgorithmResources,
    FrozenPool,
    fill_ref_logprobs,
    one_per_rollout,
    sampled,
    zeros,
)
from composer_replication.algo.context import better_sibling, demonstration_text, teacher_context
from composer_replication.algo.scoring import PrefillScorer
from composer_replication.config.advantage import OPSDAdvantage
from composer_replication.samples.rollouts import Rollout
from composer_replication.samples.wire import TrainingSample


class OPSDAlgorithm(Algorithm):
    """ref_kl against the (policy's) log-probs in a demonstration-augmented context."""

    config_class = OPSDAdvantage
    # model = "policy" (the default): the live policy scores itself, in process
    frozen_pools = (
        FrozenPool(
            "reference",
            given_as="scorer",
            model_field="model",
            error_if_missing="opsd with model = 'policy' needs the policy (policy=) or "
            "scorer=: a PrefillScorer over the live policy, e.g. "
            "LocalPrefillScorer(policy_model)",
        ),
    )

    def __init__(self, config: Any, tokenizer: Any, scorer: PrefillScorer | None = None) -> None:
        super().__init__(config)
        self.tokenizer = tokenizer
        if scorer is not None:
            self.connect_frozen_pool("reference", scorer)

    @classmethod
    def from_resources(cls, config: Any, resources: AlgorithmResources) -> OPSDAlgorithm:
        if resources.tokenizer is None:
            raise ValueError("opsd needs tokenizer= to render the demonstration context")
        return cls(config, resources.tokenizer)

    @property
    def scorer(self) -> PrefillScorer:
        """The reference's pool (the live policy's by default)."""
        return self.frozen_pool("reference")

    def demonstration(self, group: list[Rollout], i: int) -> str | None:
        """A better sibling's completion text, else the rollout's provided reference."""
        sibling = better_sibling(group, i)
        if sibling is not None:
            return demonstration_text(self.tokenizer, sibling)
        reference = group[i].reference
        return str(reference) if reference else None

    def finalize_group(
        self, group: list[Rollout], samples: list[TrainingSample]
    ) -> list[TrainingSample]:
        """ref_kl on the sampled tokens of rollouts with a demonstration, and the pending
        request for the reference's log-probs behind it (no rl)."""
        for i, (rollout, sample) in enumerate(one_per_rollout(group, samples)):
            sample.rl_weights = zeros(sample)
            demo = self.demonstration(group, i)
            sample.ref_kl_weights = sampled(rollout, 1.0) if demo else zeros(sample)
            if any(sample.ref_kl_weights):
                ids, index = teacher_context(
                    self.tokenizer, rollout, self.advantage_config.demo_template, demonstration=demo
                )
                sample.metadata[REF_CONTEXT], sample.metadata[REF_INDEX] = ids, index
            else:
                sample.ref_logprobs = zeros(sample)
        return samples

    async def score_samples(self, samples: list[TrainingSample]) -> None:
        """Reference log-probs of the sampled tokens behind the demonstration."""
        await fill_ref_logprobs(samples, self.scorer)
