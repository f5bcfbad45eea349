"""The hidden-state loss kernels under their first public name (see :mod:`.ops`).

``token_logprobs_from_hidden`` / ``cross_entropy_from_hidden`` live in
:mod:`composer_replication.ops.head`, ``jsd_from_hidden`` in
:mod:`composer_replication.ops.jsd`; the model pieces in
:mod:`composer_replication.model.parts`.
"""

from __future__ import annotations

from composer_replication.model.parts import last_hidden_states, lm_head_weight
from composer_replication.ops.head import (
    IGNORE_INDEX,
    cross_entropy_from_hidden,
    default_head_chunk_rows,
    token_logprobs_from_hidden,
)
from composer_replication.ops.jsd import jsd_from_hidden

__all__ = [
    "IGNORE_INDEX",
    "cross_entropy_from_hidden",
    "default_head_chunk_rows",
    "jsd_from_hidden",
    "last_hidden_states",
    "lm_head_weight",
    "token_logprobs_from_hidden",
]
