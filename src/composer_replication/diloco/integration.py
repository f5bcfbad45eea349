"""DiLoCo as a context manager around the training loop's step loop (torchtitan style).

The loop does::

    with diloco_context(config.diloco, policy, optimizer) as sync:
        while step < steps:
            ...; optimizer.step(); sync.after_inner_step(); ...

When ``enabled`` is False this is ``contextlib.nullcontext(NO_SYNC)`` and nothing changes.
Two backends:

- ``"torchft"``: torchft's ``DiLoCo`` with a real ``Manager`` (lighthouse, Gloo); it hooks
  ``optimizer.step`` itself, so ``after_inner_step`` does nothing.
- ``"object_store"``: DiLoCo done here over ``ObjectStoreAllReduce`` (replicas that share
  only a bucket). Every ``sync_every`` inner steps: the pseudo-gradient
  ``Δ = θ_outer - θ_local`` of the trainable parameters, flattened into ONE buffer (one
  object per replica per sync), is averaged across replicas; the outer optimizer
  (Nesterov SGD, lr 0.7, momentum 0.9: DiLoCo, arXiv:2311.08105 §2) steps ``θ_outer`` with
  ``Δ`` as its gradient, and ``θ_outer`` is loaded into the model. On entry rank 0's
  trainable parameters are broadcast, so replicas start identical even if their inits differ.

A replica may itself be several ranks training one FSDP2-sharded model (``torchrun``): the
replica-group model of torchft's HSDP, sharded inside a replica, replicated across replicas.
Every rank then runs the outer loop on its own shards only: shard ``r`` of every replica meets
the others under ``<rendezvous>/shard_<r>_of_<M>`` (replicas must use the same number of
ranks ``M``), so no rank ever holds the whole model's outer state.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from composer_replication.config.diloco import DiLoCoConfig


class NoSync:
    """What ``diloco_context`` yields when DiLoCo is off: every hook does nothing."""

    def after_inner_step(self) -> bool:
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


NO_SYNC = NoSync()


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: the local shard of an FSDP2 DTensor, else itself."""
    return param.to_local() if hasattr(param, "to_local") else param


def flatten(params: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate ``params`` (this rank's shards of sharded ones) into one float32 CPU
    vector."""
    return torch.cat([_local(p).detach().reshape(-1).to("cpu", torch.float32) for p in params])


@torch.no_grad()
def unflatten_into(flat: torch.Tensor, params: list[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` into ``params`` (this rank's shards of sharded
    ones; each keeps its dtype/device)."""
    offset = 0
    for param in params:
        p = _local(param)
        n = p.numel()
        p.copy_(flat[offset : offset + n].view_as(p))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"flat buffer has {flat.numel()} values, the parameters {offset}")


class ObjectStoreDiLoCo:
    """DiLoCo's outer loop over an ``ObjectStoreAllReduce`` (see the module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        store: Any,
        *,
        sync_every: int = 100,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        sync_initial: bool = True,
    ) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters to synchronise")
        self.store = store
        self.sync_every = sync_every
        self.inner_steps = 0
        self.outer_steps = 0
        if sync_initial:
            start = flatten(self.params)
            store.broadcast(start, src=0, name="initial_parameters")
            unflatten_into(start, self.params)
        # θ_outer lives on CPU in float32, as the outer optimizer's only parameter
        self.outer = torch.nn.Parameter(flatten(self.params))
        self.outer_optimizer = torch.optim.SGD(
            [self.outer], lr=outer_lr, momentum=outer_momentum, nesterov=nesterov
        )

    def after_inner_step(self) -> bool:
        """Count one inner step; every ``sync_every``-th runs the outer step. True if synced."""
        self.inner_steps += 1
        if self.inner_steps % self.sync_every:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> torch.Tensor:
        """The outer step; returns the averaged pseudo-gradient (for tests and metrics)."""
        pseudo_grad = self.outer.detach() - flatten(self.params)
        self.store.allreduce(pseudo_grad, name="pseudo_gradient")
        self.outer.grad = pseudo_grad
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        unflatten_into(self.outer.detach(), self.params)
        self.outer_steps += 1
        return pseudo_grad

    def state_dict(self) -> dict[str, Any]:
        return {
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "outer": self.outer.detach().clone(),
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "round_id": self.store.round_id,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner_steps = int(state["inner_steps"])
        self.outer_steps = int(state["outer_steps"])
        with torch.no_grad():
            self.outer.copy_(state["outer"])
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.store._round = int(state["round_id"])
        self.store._check_fresh = False


class TorchftSync(NoSync):
    """Yielded for the torchft backend: torchft's ``DiLoCo`` hooks ``optimizer.step`` and
    keeps its own state, so every hook here is ``NoSync``'s no-op."""

    def __init__(self, manager: Any, diloco: Any) -> None:
        self.manager = manager
        self.diloco = diloco


class _Trainable(torch.nn.Module):
    """The trainable parameters alone, so torchft never all-reduces frozen (LoRA base) weights."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList([p for p in model.parameters() if p.requires_grad])


def diloco_context(
    config: DiLoCoConfig | None,
    model: torch.nn.Module,
    inner_optimizer: torch.optim.Optimizer,
    *,
    store: Any = None,
    manager: Any = None,
) -> contextlib.AbstractContextManager[Any]:
    """The context to wrap the step loop in; yields an object with ``after_inner_step()``.

    ``store`` (object_store) or ``manager`` (torchft) inject a ready rendezvous instead of
    building one from the config.
    """
    if config is None or not config.enabled:
        return contextlib.nullcontext(NO_SYNC)
    if config.backend == "object_store":
        return _object_store_context(config, model, store)
    return _torchft_context(config, model, inner_optimizer, manager)


def shard_rendezvous(rendezvous: str) -> str:
    """Where this rank's shards meet the same shards of the other replicas: the rendezvous
    itself for a one-process replica, ``<rendezvous>/shard_<r>_of_<M>`` for rank ``r`` of a
    replica of ``M`` ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return rendezvous
    rank, world = dist.get_rank(), dist.get_world_size()
    return f"{rendezvous.rstrip('/')}/shard_{rank:04d}_of_{world:04d}"


@contextlib.contextmanager
def _object_store_context(
    config: DiLoCoConfig, model: torch.nn.Module, store: Any
) -> Iterator[ObjectStoreDiLoCo]:
    if store is None:
        if not config.rendezvous:
            raise ValueError(
                "diloco.backend = 'object_store' needs diloco.rendezvous (an s3://, gs://, "
                "hf://, file:// URI or a path every replica can reach)"
            )
        from composer_replication.diloco.serverless.object_store import ObjectStoreAllReduce

        store = ObjectStoreAllReduce(
            shard_rendezvous(config.rendezvous),
            config.resolve_rank(),
            config.resolve_world_size(),
            timeout_s=config.timeout_s,
            poll_interval_s=config.poll_interval_s,
            storage_options=config.storage_options or None,
        )
    yield ObjectStoreDiLoCo(
        model,
        store,
        sync_every=config.sync_every,
        outer_lr=config.outer_lr,
        outer_momentum=config.outer_momentum,
        nesterov=config.nesterov,
        sync_initial=config.sync_initial,
    )


@contextlib.contextmanager
def _torchft_context(
    config: DiLoCoConfig, model: torch.nn.Module, inner_optimizer: Any, manager: Any
) -> Iterator[TorchftSync]:
    from composer_replication.diloco.outer_loop import make_diloco_outer_loop, make_torchft_manager

    owned = manager is None
    if owned:
        lighthouse = config.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            raise ValueError(
                "diloco.backend = 'torchft' needs a lighthouse: set diloco.lighthouse or "
                "TORCHFT_LIGHTHOUSE (start one with the torchft_lighthouse binary)"
            )
        manager = make_torchft_manager(
            replica_id=f"replica_{config.resolve_rank()}",
            lighthouse_addr=lighthouse,
            min_replica_size=config.min_replica_size,
            timeout_s=min(config.timeout_s, 600.0),
            quorum_timeout_s=config.timeout_s,
        )
    try:
        outer = make_diloco_outer_loop(
            manager,
            [_Trainable(model)],
            inner_optimizer,
            outer_lr=config.outer_lr,
            outer_momentum=config.outer_momentum,
            nesterov=config.nesterov,
            sync_every=config.sync_every,
            fragment_sync_delay=config.fragment_sync_delay,
            fragment_update_alpha=config.fragment_update_alpha,
        )
        with outer as diloco:
            yield TorchftSync(manager, diloco)
    finally:
        if owned:
            manager.shutdown(wait=False)
