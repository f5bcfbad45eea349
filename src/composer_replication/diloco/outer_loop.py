"""DiLoCo's outer loop on torchft (arXiv:2311.08105; streaming variant arXiv:2501.18512).

Each replica takes ``sync_every`` inner optimizer steps on its own data; then the replicas
average the pseudo-gradient ``Δ = θ_global - θ_local`` and an outer optimizer (Nesterov SGD,
lr 0.7, momentum 0.9 in the paper) applies it to the global parameters. torchft's ``DiLoCo``
does this by hooking the inner optimizer's ``step``: the loop only has to call
``optimizer.step()`` inside ``with make_diloco_outer_loop(...):``.

This module also starts the two torchft pieces a CPU run needs: a lighthouse (the quorum
server every replica group talks to) and a ``Manager`` over a per-replica-group TCPStore
with ``ProcessGroupGloo``. torchft is optional (extra ``diloco``); every function here
imports it lazily and raises ``RuntimeError`` naming the extra when it is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

_INSTALL_HINT = "pip install 'composer-replication[diloco]' (torchft==0.2.0)"


def require_torchft() -> Any:
    """Import and return ``torchft``, or raise ``RuntimeError`` saying how to install it."""
    try:
        import torchft
    except ImportError as exc:
        raise RuntimeError(
            f"DiLoCo on torchft needs the 'diloco' extra, and torchft is not importable ({exc}); "
            f"install it with: {_INSTALL_HINT}, or use the object_store backend"
        ) from exc
    return torchft


def make_diloco_outer_loop(
    manager: Any,
    model_fragments: Sequence[torch.nn.Module] | torch.nn.Module,
    inner_optimizer: torch.optim.Optimizer,
    *,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    nesterov: bool = True,
    sync_every: int = 100,
    fragment_sync_delay: int = 0,
    fragment_update_alpha: float = 0.0,
    outer_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
    use_bucketization: bool | None = None,
) -> Any:
    """A torchft ``DiLoCo`` context manager: enter it around the step loop.

    ``manager`` is a torchft ``Manager`` built with ``use_async_quorum=False`` (see
    ``make_torchft_manager``) or an ``ObjectStoreManager``. ``model_fragments`` is a module
    or a list of modules; with several fragments, streaming DiLoCo syncs one fragment every
    ``sync_every / len(fragments)`` steps. The outer optimizer is, per fragment,
    ``outer_optimizer(params)`` when given, else SGD(lr=outer_lr, momentum=outer_momentum,
    nesterov=nesterov). ``use_bucketization=None`` flattens the pseudo-gradients into one
    buffer for object-store managers (one object per sync instead of one per parameter)
    and keeps torchft's per-parameter all-reduce otherwise.
    """
    require_torchft()
    from torchft.local_sgd import DiLoCo

    fragments = (
        [model_fragments] if isinstance(model_fragments, torch.nn.Module) else list(model_fragments)
    )
    if not fragments:
        raise ValueError("model_fragments is empty: pass the model or a list of its parts")
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1, got {sync_every}")
    if sync_every % len(fragments) != 0:
        raise ValueError(
            f"sync_every={sync_every} must be a multiple of the {len(fragments)} fragments "
            "(each fragment syncs every sync_every / n_fragments steps)"
        )
    if not 0 <= fragment_sync_delay < sync_every // len(fragments):
        raise ValueError(
            f"fragment_sync_delay={fragment_sync_delay} must be in [0, "
            f"{sync_every // len(fragments)}): a fragment must land before it syncs again"
        )
    if not 0.0 <= fragment_update_alpha <= 1.0:
        raise ValueError(f"fragment_update_alpha must be in [0, 1], got {fragment_update_alpha}")
    if getattr(manager, "_use_async_quorum", False):
        raise ValueError(
            "DiLoCo needs a synchronous quorum: build the torchft Manager with "
            "use_async_quorum=False (make_torchft_manager does)"
        )

    def build_outer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if outer_optimizer is not None:
            return outer_optimizer(params)
        return torch.optim.SGD(params, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)

    outer = [build_outer(list(f.parameters())) for f in fragments]
    if use_bucketization is None:
        use_bucketization = bool(getattr(manager, "is_object_store", False))
    return DiLoCo(
        manager,
        fragments,
        inner_optimizer,
        outer,
        sync_every=sync_every,
        fragment_sync_delay=fragment_sync_delay,
        fragment_update_alpha=fragment_update_alpha,
        use_bucketization=use_bucketization,
        # pinned memory needs an accelerator; on CPU it only costs a warning
        pin_memory=torch.cuda.is_available(),
    )


def start_lighthouse(
    bind: str = "127.0.0.1:0",
    *,
    min_replicas: int = 1,
    join_timeout_ms: int = 1000,
    heartbeat_timeout_ms: int = 5000,
) -> Any:
    """Start a torchft ``LighthouseServer`` in this process; ``.address()`` is its URL.

    ``heartbeat_timeout_ms`` bounds how long a dead replica stays in the quorum; a
    standalone lighthouse is the wheel's ``torchft_lighthouse`` binary instead.
    """
    require_torchft()
    from torchft.coordination import LighthouseServer

    return LighthouseServer(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )


def make_torchft_manager(
    *,
    replica_id: str,
    lighthouse_addr: str,
    min_replica_size: int = 1,
    timeout_s: float = 60.0,
    quorum_timeout_s: float = 60.0,
    hostname: str = "127.0.0.1",
    load_state_dict: Callable[[Any], None] | None = None,
    state_dict: Callable[[], Any] | None = None,
) -> Any:
    """A torchft ``Manager`` for a one-process replica group on CPU.

    It owns a fresh TCPStore on 127.0.0.1 (the per-replica-group store torchft needs), a
    ``ProcessGroupGloo`` and ``use_async_quorum=False`` (required by DiLoCo). ``replica_id``
    must end in digits (torchft derives the global rank from them), e.g. ``"replica_3"``.
    """
    require_torchft()
    from torch.distributed import TCPStore
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    if not replica_id or not replica_id[-1].isdigit():
        raise ValueError(f"replica_id {replica_id!r} must end in digits, e.g. 'replica_0'")
    timeout = timedelta(seconds=timeout_s)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=min_replica_size,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=quorum_timeout_s),
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse_addr,
        replica_id=replica_id,
        hostname=hostname,
        port=0,
    )
    manager._composer_store = store  # keep the master store alive as long as the manager
    return manager
