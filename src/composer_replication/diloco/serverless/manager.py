"""``ObjectStoreManager``: the torchft ``Manager`` surface over an ``ObjectStoreAllReduce``.

torchft's ``DiLoCo`` talks to a ``Manager`` for quorum, all-reduce and commit. Serverless
replicas have no lighthouse and no network between them, so this adapter answers those
calls from the object store: the quorum is always the fixed ``world_size`` (a dead peer
shows up as a ``TimeoutError`` from the store, never as a smaller quorum), every all-reduce
completes before it returns, and ``should_commit`` is always True. ``MockManager`` is the
seed name, kept as an alias.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from composer_replication.diloco.serverless.object_store import ObjectStoreAllReduce


class CompletedWork:
    """A torchft/c10d ``Work`` that is already done; its future holds the reduced tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._tensor)
        return future


class ObjectStoreManager:
    """A torchft-``Manager``-shaped adapter; ``store`` does the all-reduce.

    Attributes ``num_participants`` (= world size) and ``rank`` are plain ints.
    """

    is_object_store = True  # make_diloco_outer_loop flattens pseudo-gradients for us
    _use_async_quorum = False  # DiLoCo checks this private torchft attribute

    def __init__(self, store: ObjectStoreAllReduce) -> None:
        self.store = store
        self.num_participants: int = store.world_size
        self.rank: int = store.rank
        self._step = 0
        self._quorums = 0
        self._state_dict_read_allowed = True
        self._load_fns: dict[str, Callable[[Any], None]] = {}
        self._save_fns: dict[str, Callable[[], Any]] = {}

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = None
    ) -> CompletedWork:
        """Average ``tensor`` in place across replicas (one store round); ``should_quantize``
        is accepted for signature compatibility and ignored (payloads go up as they are)."""
        if reduce_op is not None and "AVG" not in str(reduce_op).upper():
            raise ValueError(f"ObjectStoreManager only averages; got reduce_op={reduce_op!r}")
        self.store.allreduce(tensor)
        return CompletedWork(tensor)

    def start_quorum(self, allow_heal: bool = True, shrink_only: bool = False, timeout=None):
        self._quorums += 1  # the quorum is the fixed world; nothing to negotiate

    def wait_quorum(self) -> None:
        return None

    def should_commit(self, timeout: Any = None) -> bool:
        self._step += 1
        return True

    def current_step(self) -> int:
        return self._step

    def is_leader(self) -> bool:
        return self.rank == 0

    def errored(self) -> None:
        return None

    def allow_state_dict_read(self) -> None:
        self._state_dict_read_allowed = True

    def disallow_state_dict_read(self) -> None:
        self._state_dict_read_allowed = False

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        if key in self._load_fns:
            raise ValueError(f"state dict function {key!r} is already registered")
        self._load_fns[key] = load_state_dict
        self._save_fns[key] = state_dict

    def state_dict(self) -> dict[str, Any]:
        """The step, the store's round and every registered user state (for checkpoints)."""
        return {
            "step": self._step,
            "round_id": self.store.round_id,
            "user": {key: fn() for key, fn in self._save_fns.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._step = int(state["step"])
        self.store._round = int(state["round_id"])
        self.store._check_fresh = False
        for key, value in state.get("user", {}).items():
            if key in self._load_fns:
                self._load_fns[key](value)

    def shutdown(self, wait: bool = True) -> None:
        return None


MockManager = ObjectStoreManager
