"""``ObjectStoreManager``: the torchft ``Manager`` surface over an ``ObjectStoreAllReduce``.

torchft's ``DiLoCo`` talks to a ``Manager`` for quorum, all-reduce and commit. Serverless
replicas have no lighthouse and no network between them, so this adapter answers those
calls from the object store: the quorum is always the fixed ``world_size`` (a dead peer
shows up as a ``TimeoutError`` from the store, never as a smaller quorum) and every
all-reduce completes before it returns. The step bookkeeping is torchft's:
``start_quorum()`` readies a step and returns None, ``wait_quorum()`` returns None and
needs a ``start_quorum()`` first, ``should_commit()`` returns True and advances
``current_step()`` by one and ``batches_committed()`` by the number of participants unless
an error was reported since the quorum (``report_error``), in which case it returns False
and the step stays. ``MockManager`` is the seed name, kept as an alias, and
``_ImmediateWork`` the seed's name of ``CompletedWork``.
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


class QuorumNotStartedError(RuntimeError, AssertionError):
    """``wait_quorum`` before any ``start_quorum`` (torchft asserts the same)."""


class ParticipantCount(int):
    """The number of replicas: an int (the seed's attribute) that torchft-style code may
    also call (``manager.num_participants()``, torchft's method)."""

    def __call__(self) -> int:
        return int(self)


class ObjectStoreManager:
    """A torchft-``Manager``-shaped adapter; ``store`` does the all-reduce.

    Attributes ``num_participants`` (= world size, an int that can also be called as
    torchft's method) and ``rank``.
    """

    is_object_store = True  # make_diloco_outer_loop flattens pseudo-gradients for us
    _use_async_quorum = False  # DiLoCo checks this private torchft attribute

    def __init__(self, store: ObjectStoreAllReduce) -> None:
        self.store = store
        self.num_participants = ParticipantCount(store.world_size)
        self.rank: int = store.rank
        self._step = 0
        self._batches_committed = 0
        self._quorums = 0
        self._quorum_started = False
        self._errored: BaseException | None = None
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

    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: Any = None
    ) -> None:
        """Ready the manager for a new step: clears a reported error; the quorum is the
        fixed world, so there is nothing to negotiate or heal (the arguments are accepted
        for torchft compatibility)."""
        self._quorums += 1
        self._quorum_started = True
        self._errored = None

    def wait_quorum(self) -> None:
        """Return once the quorum is ready (at once: it is fixed).

        Raises:
            QuorumNotStartedError: no ``start_quorum()`` was called yet.
        """
        if not self._quorum_started:
            raise QuorumNotStartedError("must call start_quorum before wait_quorum")

    def should_commit(self, timeout: Any = None) -> bool:
        """True, and the step advances, unless an error was reported since the quorum."""
        if self._errored is not None:
            return False
        self._step += 1
        self._batches_committed += int(self.num_participants)
        return True

    def current_step(self) -> int:
        """Steps committed so far (``should_commit`` calls that returned True)."""
        return self._step

    def batches_committed(self) -> int:
        """Batches committed over all replicas: participants summed over committed steps."""
        return self._batches_committed

    def participating_rank(self) -> int | None:
        """This replica's rank in the quorum, None before the first ``start_quorum``."""
        return self.rank if self._quorum_started else None

    def is_leader(self) -> bool:
        return self.rank == 0

    def report_error(self, error: BaseException) -> None:
        """Record an error: this step's ``should_commit`` returns False."""
        self._errored = error

    def errored(self) -> BaseException | None:
        """The error reported since the last ``start_quorum``, or None."""
        return self._errored

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
            "batches_committed": self._batches_committed,
            "round_id": self.store.round_id,
            "user": {key: fn() for key, fn in self._save_fns.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._step = int(state["step"])
        self._batches_committed = int(state.get("batches_committed", 0))
        self.store._round = int(state["round_id"])
        self.store._check_fresh = False
        for key, value in state.get("user", {}).items():
            if key in self._load_fns:
                self._load_fns[key](value)

    def shutdown(self, wait: bool = True) -> None:
        return None


MockManager = ObjectStoreManager
_ImmediateWork = CompletedWork
