"""Distillation and preference losses, pure PyTorch: the public face of their
implementations in :mod:`composer_replication.ops` (``distillation.dpo`` and the other
submodules are the very ``ops`` modules under their first names).

- :mod:`.simpo`: SimPO, reference-free preference loss on average log-probs (arXiv 2405.14734).
- :mod:`.dpo`: sigmoid DPO with cDPO label smoothing (arXiv 2305.18290).
- :mod:`.taid`: TAID loss and its adaptive ``t`` schedule (arXiv 2501.16937).
- :mod:`.entropy_aware_opd`: forward/reverse KL mixed by teacher entropy (arXiv 2603.07079).

Every loss is a pure function of tensors; the only state is :class:`TAIDScheduler`'s ``t``.
"""

from __future__ import annotations

from composer_replication.ops.dpo import (
    dpo_implicit_rewards,
    dpo_loss,
    sequence_logprob_sum,
)
from composer_replication.ops.entropy_aware_opd import (
    entropy_aware_opd_loss,
    teacher_entropy,
)
from composer_replication.ops.simpo import avg_sequence_logprob, simpo_loss
from composer_replication.ops.taid import TAIDScheduler, taid_loss

__all__ = [
    "TAIDScheduler",
    "avg_sequence_logprob",
    "dpo_implicit_rewards",
    "dpo_loss",
    "entropy_aware_opd_loss",
    "sequence_logprob_sum",
    "simpo_loss",
    "taid_loss",
    "teacher_entropy",
]
