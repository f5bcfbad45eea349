"""``ObjectStoreManager``: the torchft ``Manager`` surface over an ``ObjectStoreAllReduce``.

torchft's ``DiLoCo`` talks to a ``Manager`` for quorum, all-reduce and commit. Serverless
replicas have no lighthouse and no network between them, so this adapter answers those
calls from the object store: the quorum is always the fixed ``world_size`` (a dead peer
shows up as a ``TimeoutError`` from the store, never as a smaller quorum) and every
all-reduce completes before it returns. Step bookkeeping (the documented ``MockManager``
surface): ``start_quorum()`` begins a step and advances ``current_step()`` by one (so code
that picks a fragment from ``current_step()`` between the quorum and the commit sees the step
being synced), ``wait_quorum()`` needs a ``start_quorum()`` first and returns the quorum's
size (the fixed world size), ``should_commit()`` returns True and adds the participants to
``batches_committed()`` unless an error was reported since the quorum (``report_error``),
in which case it returns False and takes the step back (the next quorum retries it, as
torchft retries a failed fragment). ``MockManager`` is the seed name, kept as an alias, and
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
        self._step_open = False  # a quorum's step not yet committed or taken back
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
        """Begin a new step: ``current_step()`` advances by one and a reported error is
        cleared. The quorum is the fixed world, so there is nothing to negotiate or heal
        (the arguments are accepted for torchft compatibility). A quorum started while the
        previous step is still open (no ``should_commit`` yet) counts as a new step too."""
        self._quorums += 1
        self._quorum_started = True
        self._errored = None
        self._step += 1
        self._step_open = True

    def wait_quorum(self) -> int:
        """Return the quorum's size (the fixed world size) once it is ready: at once.

        Raises:
            QuorumNotStartedError: no ``start_quorum()`` was called yet.
        """
        if not self._quorum_started:
            raise QuorumNotStartedError("must call start_quorum before wait_quorum")
        return int(self.num_participants)

    def should_commit(self, timeout: Any = None) -> bool:
        """True unless an error was reported since the quorum. The first call after a
        quorum adds the participants to ``batches_committed()`` (True) or takes the step
        back (False: the next quorum starts the same step again)."""
        committed = self._errored is None
        if self._step_open:
            self._step_open = False
            if committed:
                self._batches_committed += int(self.num_participants)
            else:
                self._step -= 1
        return committed

    def current_step(self) -> int:
        """Quorums started (``start_quorum``), less the steps taken back by a failed
        ``should_commit``: after a commit, the steps committed so far."""
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
        """The committed step (an open quorum's step is not saved: a resumed manager starts
        it again), the store's round and every registered user state (for checkpoints)."""
        return {
            "step": self._step - int(self._step_open),
            "batches_committed": self._batches_committed,
            "round_id": self.store.round_id,
            "user": {key: fn() for key, fn in self._save_fns.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._step = int(state["step"])
        self._step_open = False
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
