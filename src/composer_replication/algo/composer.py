"""``composer``: the full Composer recipe, rl + jsd + dpo on one group.

- Dr.GRPO advantages (arXiv 2503.20783) on every rollout's sampled tokens (``rl``);
- SDPO self-distillation at error sites (arXiv 2601.20802; see :mod:`.sdpo`) with jsd
  weight ``alpha_sdpo``;
- ``pairs_per_group`` trace-replay DPO pairs (see :mod:`.replay_dpo`) drawn from the pair
  pool (``pairs_path``, default the shipped pairs), each with weight ``beta_replay``;
  ``beta_replay = 0`` turns the channel off.

The weights' defaults are ``ComposerAdvantage``'s (config/advantage.py), their one owner.

The trainer divides each component's sum by its own token (pair) count: a weight of
``alpha_sdpo`` on every jsd token is ``alpha_sdpo`` times the jsd mean.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from composer_replication.algo.base import AlgorithmResources
from composer_replication.algo.replay_dpo import PairDrawing, build_pair_pool, pair_sample
from composer_replication.algo.scoring import PrefillScorer
from composer_replication.algo.sdpo import grpo_with_self_distillation
from composer_replication.config.advantage import ComposerAdvantage
from composer_replication.samples.rollouts import Rollout
from composer_replication.samples.wire import DPOPairTokens, TrainingSample


class ComposerAlgorithm(PairDrawing):
    """Dr.GRPO + alpha_sdpo * SDPO + beta_replay * trace-replay DPO."""

    config_class = ComposerAdvantage

    def __init__(
        self,
        config: Any,
        tokenizer: Any,
        pairs: Sequence[DPOPairTokens] = (),
        *,
        reference_scorer: PrefillScorer | None = None,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(config)
        self.tokenizer = tokenizer
        self._draw_from(pairs, rng, reference_scorer)

    @classmethod
    def from_resources(cls, config: Any, resources: AlgorithmResources) -> ComposerAlgorithm:
        if resources.tokenizer is None:
            raise ValueError("composer needs tokenizer= to render hinted teacher contexts")
        cfg = config.advantage
        pairs = []
        if cfg.beta_replay > 0:
            pairs = build_pair_pool(
                resources.pairs, cfg.pairs_path, resources.tokenizer, weight=cfg.beta_replay
            )
        return cls(config, resources.tokenizer, pairs, rng=resources.rng)

    def finalize_group(
        self, group: list[Rollout], samples: list[TrainingSample]
    ) -> list[TrainingSample]:
        """Dr.GRPO + SDPO on the rollouts' samples, then the group's DPO pairs."""
        cfg = self.advantage_config
        grpo_with_self_distillation(group, samples, cfg, self.tokenizer)
        if cfg.beta_replay > 0:
            samples += [pair_sample(p, self.name) for p in self.pool.draw(cfg.pairs_per_group)]
        return samples

    async def score_samples(self, samples: list[TrainingSample]) -> None:
        """DPO reference log-probs of the pairs (left to the trainer without a scorer)."""
        await self.score_pairs(samples)
