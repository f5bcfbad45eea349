"""The seed API's path of the three-channel Composer loss on one padded batch (``compose_loss``):
the same objects as :mod:`composer_replication.ops.compose`, where the code lives."""

from composer_replication.ops.compose import (
    DPO_VARIANTS,
    SDPO_WRAPPERS,
    LossComponents,
    compose_loss,
    divergence_settings,
    pair_loss_settings,
    sdpo_tokens,
    sequence_logps,
)

__all__ = [
    "DPO_VARIANTS",
    "SDPO_WRAPPERS",
    "LossComponents",
    "compose_loss",
    "divergence_settings",
    "pair_loss_settings",
    "sdpo_tokens",
    "sequence_logps",
]
