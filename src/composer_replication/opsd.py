"""The seed API's path of ``generalized_jsd_loss`` on (B, T, V) logits with trl's GKD conventions:
the same objects as :mod:`composer_replication.ops.logits_jsd`, where the code lives."""

from composer_replication.ops.logits_jsd import (
    IGNORE_INDEX,
    REDUCTIONS,
    default_chunk_rows,
    generalized_jsd_loss,
    jsd_rows,
    jsd_rows_with_grads,
    per_token_jsd,
)

__all__ = [
    "IGNORE_INDEX",
    "REDUCTIONS",
    "default_chunk_rows",
    "generalized_jsd_loss",
    "jsd_rows",
    "jsd_rows_with_grads",
    "per_token_jsd",
]
