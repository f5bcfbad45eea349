"""Data parallelism of the native trainer: N ranks under ``torchrun`` (gloo on CPUs, NCCL
on GPUs), the policy sharded with FSDP2, per-component token counts summed over ranks.

Cheap to import: torch.distributed loads inside the functions.
"""

from __future__ import annotations

from composer_replication.distributed.counts import sum_counts_over_ranks
from composer_replication.distributed.fsdp import shard_policy
from composer_replication.distributed.setup import (
    DEFAULT_TIMEOUT_S,
    backend_for,
    init_from_env,
    launched_by_torchrun,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "backend_for",
    "init_from_env",
    "launched_by_torchrun",
    "shard_policy",
    "sum_counts_over_ranks",
]
