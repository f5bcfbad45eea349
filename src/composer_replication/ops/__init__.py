"""Pure tensor math on hidden states: the ONE implementation of every loss piece.

The native trainer step, the trl trainer (``ComposerReplicationTrainer``) and
``loss.compose_loss`` all compute their losses here, through :mod:`.assembler`:

- :mod:`.head`: per-token log-probs and cross-entropy from hidden states and the LM head,
  in token chunks (never (B, T, V) logits);
- :mod:`.jsd`: the generalized JSD kernel (rows of logits, or hidden states);
- :mod:`.divergence`: the per-token student/teacher divergence (JSD, TAID, entropy-aware
  OPD) with the per-token clip;
- :mod:`.self_distillation`: that divergence at aligned positions of a student and a
  teacher context (SDPO), the teacher forward included;
- :mod:`.pairs`: pair log-probs with reference caching, and the DPO / SimPO reductions;
- :mod:`.dpo`, :mod:`.simpo`: the preference losses on summed / averaged log-probs
  (arXiv 2305.18290, 2405.14734);
- :mod:`.taid`, :mod:`.entropy_aware_opd`: the TAID loss and its ``t`` schedule
  (arXiv 2501.16937) and entropy-aware OPD (arXiv 2603.07079) on logits;
- :mod:`.token_losses`: the token-level ``rl`` (DPPO trust region), ``ce`` and ``ref_kl``
  components and the k2 trust mask;
- :mod:`.trust_region`: the ``ref_kl`` component's trust-region metrics (per sample, per
  step);
- :mod:`.assembler`: one packed micro-batch in, every component's sum out: the one place
  the components meet the model.

``distillation/`` is the public face of :mod:`.dpo`, :mod:`.simpo`, :mod:`.taid` and
:mod:`.entropy_aware_opd` under their first names.
"""

from __future__ import annotations

from composer_replication.ops.divergence import DivergenceSettings, token_divergence
from composer_replication.ops.head import (
    IGNORE_INDEX,
    cross_entropy_from_hidden,
    token_logprobs_from_hidden,
)
from composer_replication.ops.jsd import jsd_from_hidden
from composer_replication.ops.pairs import (
    PairLossSettings,
    fill_reference_logps,
    pair_logps,
    pair_terms,
    sequence_logps,
)
from composer_replication.ops.self_distillation import (
    AlignedTokens,
    aligned_from_index,
    aligned_from_masks,
    divergence_terms,
)
from composer_replication.ops.trust_region import (
    REF_KL_SAMPLE_METRICS,
    mismatch_kl,
    outside_trust_region,
    ref_kl_sample_metrics,
    ref_kl_step_metrics,
)

__all__ = [
    "IGNORE_INDEX",
    "REF_KL_SAMPLE_METRICS",
    "AlignedTokens",
    "DivergenceSettings",
    "PairLossSettings",
    "aligned_from_index",
    "aligned_from_masks",
    "cross_entropy_from_hidden",
    "divergence_terms",
    "fill_reference_logps",
    "jsd_from_hidden",
    "mismatch_kl",
    "outside_trust_region",
    "pair_logps",
    "pair_terms",
    "ref_kl_sample_metrics",
    "ref_kl_step_metrics",
    "sequence_logps",
    "token_divergence",
    "token_logprobs_from_hidden",
]
