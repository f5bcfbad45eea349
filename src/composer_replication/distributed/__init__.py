"""Data parallelism of the native trainer: N ranks under ``torchrun`` (gloo on CPUs, NCCL
on GPUs), the policy sharded with FSDP2, per-component token counts summed over ranks.

Cheap to import: torch.distributed loads inside the functions.
"""

from __future__ import annotations

from composer_replication.distributed.counts import sum_counts_over_ranks, sum_values_over_ranks
from composer_replication.distributed.data_parallel import (
    shard_for_training,
    start_data_parallel,
)
from composer_replication.distributed.fsdp import (
    GatheredWeights,
    NoSharding,
    gathered_policy,
    shard_policy,
)
from composer_replication.distributed.launch import launch_torchrun, torchrun_command
from composer_replication.distributed.setup import (
    DEFAULT_TIMEOUT_S,
    backend_for,
    init_from_env,
    join_local_group,
    launched_by_torchrun,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "GatheredWeights",
    "NoSharding",
    "backend_for",
    "gathered_policy",
    "init_from_env",
    "join_local_group",
    "launch_torchrun",
    "launched_by_torchrun",
    "shard_for_training",
    "shard_policy",
    "start_data_parallel",
    "sum_counts_over_ranks",
    "sum_values_over_ranks",
    "torchrun_command",
]
