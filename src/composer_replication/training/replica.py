"""What a DiLoCo replica runs: the run config with DiLoCo switched on, trained in process.

``composer-replication diloco launch`` starts one of these per replica through an executor
(by its import path, :data:`composer_replication.diloco.cli.TRAIN_REPLICA`); the replicas
meet through the object-store rendezvous.
"""

from __future__ import annotations

from typing import Any

__all__ = ["train_replica"]


def train_replica(
    config_uri: str,
    rendezvous_uri: str,
    world_size: int,
    overrides: list[str] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """What each launched replica runs: the run config with DiLoCo on, trained in process.

    The replica's output goes to ``<output_dir>/rank_<r>``; a kill-switch stop raises
    ``CollapseStopError`` (the executor records the replica as failed).
    """
    import fsspec

    from composer_replication.config.diloco import DiLoCoConfig
    from composer_replication.config.run import RunConfig
    from composer_replication.diloco.serverless.replica_entrypoint import replica_rank
    from composer_replication.training.loop import train

    rank = replica_rank(int(world_size))
    with fsspec.open(config_uri, "r", **(storage_options or {})) as fh:
        text = fh.read()
    config = RunConfig.from_toml(text, list(overrides or []))
    diloco = config.diloco.model_dump() | {
        "enabled": True,
        "backend": "object_store",
        "rendezvous": rendezvous_uri,
        "world_size": int(world_size),
        "rank": rank,
    }
    if storage_options:
        diloco["storage_options"] = dict(storage_options)
    config = config.model_copy(
        update={
            "diloco": DiLoCoConfig.model_validate(diloco),
            "output_dir": f"{config.output_dir.rstrip('/')}/rank_{rank}",
        }
    )
    train(config)
