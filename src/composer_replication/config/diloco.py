"""``DiLoCoConfig``: the ``[diloco]`` table of a run config (DiLoCo, arXiv 2311.08105)."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: Environment variables a launched replica reads its rank and the world size from.
RANK_ENV = "REPLICA_RANK"
WORLD_SIZE_ENV = "REPLICA_WORLD_SIZE"


class DiLoCoConfig(BaseModel):
    """The ``[diloco]`` table of a run config."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = Field(False, description="Wrap training in DiLoCo (off: plain training).")
    backend: Literal["torchft", "object_store"] = Field(
        "object_store",
        description="torchft (lighthouse + Gloo/NCCL) or object_store (replicas meet in a bucket).",
    )
    sync_every: int = Field(100, ge=1, description="Inner steps between outer steps (H).")
    outer_lr: float = Field(0.7, gt=0, description="Outer SGD learning rate.")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="Outer SGD momentum.")
    nesterov: bool = Field(True, description="Nesterov momentum in the outer step.")
    rendezvous: str | None = Field(
        None,
        description="object_store: the shared URI (s3://, gs://, az://, hf://, file://, path).",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options, e.g. client_kwargs.endpoint_url."
    )
    world_size: int | None = Field(
        None, ge=1, description="Replicas; null: the REPLICA_WORLD_SIZE environment variable."
    )
    rank: int | None = Field(
        None, ge=0, description="This replica's rank; null: read from the rank_env variable."
    )
    rank_env: str = Field(RANK_ENV, description="Environment variable holding the rank.")
    timeout_s: float = Field(1800.0, gt=0, description="How long a sync waits for peers.")
    poll_interval_s: float = Field(1.0, gt=0, description="Object-store polling interval.")
    sync_initial: bool = Field(
        True, description="object_store: broadcast rank 0's parameters before the first step."
    )
    lighthouse: str | None = Field(
        None, description="torchft: lighthouse URL; null: the TORCHFT_LIGHTHOUSE variable."
    )
    min_replica_size: int = Field(1, ge=1, description="torchft: replicas needed to commit.")
    fragment_sync_delay: int = Field(0, ge=0, description="torchft streaming DiLoCo tau.")
    fragment_update_alpha: float = Field(
        0.0, ge=0, le=1, description="torchft: mix of local into global params after a sync."
    )

    def resolve_rank(self) -> int:
        if self.rank is not None:
            return self.rank
        raw = os.environ.get(self.rank_env)
        if raw is None or not raw.strip().isdigit():
            raise RuntimeError(
                f"diloco.rank is unset and {self.rank_env}={raw!r}: set diloco.rank or export "
                f"{self.rank_env} (the diloco launcher sets it for every replica)"
            )
        return int(raw)

    def resolve_world_size(self) -> int:
        if self.world_size is not None:
            return self.world_size
        raw = os.environ.get(WORLD_SIZE_ENV)
        if raw is None or not raw.strip().isdigit() or int(raw) < 1:
            raise RuntimeError(
                f"diloco.world_size is unset and {WORLD_SIZE_ENV}={raw!r}: set diloco.world_size"
            )
        return int(raw)
