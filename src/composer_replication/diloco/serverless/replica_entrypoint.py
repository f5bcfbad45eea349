"""What one serverless replica runs: join the object-store rendezvous, then train.

``main`` reads the rank from ``REPLICA_RANK`` (set by every executor), opens an
``ObjectStoreAllReduce`` on ``rendezvous_uri`` and calls
``trainer_module.trainer_fn(manager=ObjectStoreManager(store), rank=rank,
world_size=world_size, **trainer_kwargs)``, as the seed does, so a seed-style
``train(manager, rank, world_size)`` works; a trainer that takes neither ``rank`` nor
``world_size`` (nor ``**kwargs``) is called without them. ``main`` returns what the
trainer returns. The trainer uses ``manager`` as it would a torchft Manager (e.g. with
``make_diloco_outer_loop``) or ``manager.store.allreduce`` directly. As a command::

    python -m composer_replication.diloco.serverless.replica_entrypoint \
        --rendezvous s3://bucket/run-1 --world-size 4 --trainer-module my.train \
        [--trainer-fn train] [--trainer-kwargs-json '{"steps": 100}']
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
from typing import Any

from composer_replication.diloco.serverless.base import RANK_ENV
from composer_replication.diloco.serverless.manager import ObjectStoreManager
from composer_replication.diloco.serverless.object_store import ObjectStoreAllReduce


def replica_rank(world_size: int, env_var: str = RANK_ENV) -> int:
    """This replica's rank from the environment, checked against ``world_size``."""
    raw = os.environ.get(env_var)
    if raw is None:
        raise RuntimeError(
            f"{env_var} is not set: a serverless replica gets its rank from the executor "
            f"that launched it; set {env_var}=<0..{world_size - 1}> to run one by hand"
        )
    try:
        rank = int(raw)
    except ValueError:
        raise ValueError(f"{env_var}={raw!r} is not an integer rank") from None
    if not 0 <= rank < world_size:
        raise ValueError(f"{env_var}={rank} is out of range for world_size={world_size}")
    return rank


def main(
    rendezvous_uri: str,
    world_size: int,
    trainer_module: str,
    trainer_fn: str = "train",
    trainer_kwargs: dict[str, Any] | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    timeout_s: float = 1800.0,
    poll_interval_s: float = 1.0,
) -> Any:
    """Join ``rendezvous_uri`` as rank ``$REPLICA_RANK`` of ``world_size``; run the trainer."""
    world_size = int(world_size)
    rank = replica_rank(world_size)
    module = importlib.import_module(trainer_module)
    function = getattr(module, trainer_fn, None)
    if not callable(function):
        raise ValueError(f"trainer module {trainer_module!r} has no callable {trainer_fn!r}")
    store = ObjectStoreAllReduce(
        rendezvous_uri,
        rank,
        world_size,
        timeout_s=timeout_s,
        poll_interval_s=poll_interval_s,
        storage_options=storage_options,
    )
    kwargs = dict(trainer_kwargs or {})
    kwargs.update(_placement_kwargs(function, rank, world_size, kwargs))
    return function(manager=ObjectStoreManager(store), **kwargs)


def _placement_kwargs(
    function: Any, rank: int, world_size: int, trainer_kwargs: dict[str, Any]
) -> dict[str, int]:
    """``rank=`` and ``world_size=`` for the trainer, those its signature accepts."""
    clash = sorted({"manager", "rank", "world_size"} & set(trainer_kwargs))
    if clash:
        raise ValueError(
            f"trainer_kwargs set {clash}: the replica entrypoint passes manager, rank and "
            "world_size itself; remove them from trainer_kwargs"
        )
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # no introspectable signature: pass them, as the seed does
        return {"rank": rank, "world_size": world_size}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return {"rank": rank, "world_size": world_size}
    placement = {"rank": rank, "world_size": world_size}
    return {
        name: value
        for name, value in placement.items()
        if name in parameters and parameters[name].kind is not inspect.Parameter.POSITIONAL_ONLY
    }


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one serverless DiLoCo replica.")
    parser.add_argument("--rendezvous", required=True, help="object-store URI both ranks use")
    parser.add_argument("--world-size", required=True, type=int, help="number of replicas")
    parser.add_argument("--trainer-module", required=True, help="module with the trainer fn")
    parser.add_argument("--trainer-fn", default="train", help="function to call (train)")
    parser.add_argument("--trainer-kwargs-json", default="{}", help="its keyword arguments")
    parser.add_argument("--storage-options-json", default="{}", help="fsspec options")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="wait for peers")
    parser.add_argument("--poll-interval-s", type=float, default=1.0, help="store polling")
    ns = parser.parse_args(argv)
    main(
        ns.rendezvous,
        ns.world_size,
        ns.trainer_module,
        ns.trainer_fn,
        json.loads(ns.trainer_kwargs_json),
        storage_options=json.loads(ns.storage_options_json) or None,
        timeout_s=ns.timeout_s,
        poll_interval_s=ns.poll_interval_s,
    )
    return 0


if __name__ == "__main__":
    sys.exit(cli())
