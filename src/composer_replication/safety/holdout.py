"""Deterministic train / held-out split of task ids, and the guard that keeps them apart.

The held-out score that feeds `HeldOutGuard` is only meaningful if held-out tasks are never
trained on and never fed to the task generator: recursive self-training loses the tails
first, then collapses, so the held-out pool must stay anchored to real tasks that are never
fed back (Shumailov et al., Nature 2024). Held-out tests alone help only a little (EvilGenie,
arXiv 2511.21654); this split is one layer of defence in depth.

Membership is a pure function of `(salt, task_id, heldout_fraction)`: the first 8 bytes of
`sha256(salt + "\\x00" + group)` read as a big-endian integer, divided by 2**64, give a
uniform number u in [0, 1); the task is held out iff u < heldout_fraction. The group is the
task id up to its first ``#`` (the whole id when it has none): tasks made from one source
(the bugs injected into one function, ``fd:<repo>:<file>:<function>#bug:...``) share their
group, so they are held out together and one never trains on what another evaluates. Unlike Python's
`hash()` this is the same in every process, on every machine and Python version. Raising the
fraction only moves tasks from train to held-out, never back.

Training-batch builders and task generators call `check_trainable` / `assert_trainable`
(or `filter_trainable`) at their boundary, so a held-out id cannot reach them through the
public API. Wherever a task id is known, a split is in force by default (`DEFAULT_SPLIT`,
the same fraction and salt as a run config's defaults); passing ``split=None`` is the
explicit way to say a pool has no held-out part. Task files record the split they were
made with (`to_record`), and a run refuses tasks split differently from its own
(`check_same_split`). Pure Python (no torch import).
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "DEFAULT_HELDOUT_FRACTION",
    "DEFAULT_HELDOUT_SALT",
    "DEFAULT_SPLIT",
    "HeldoutLeakError",
    "HeldoutSplit",
    "HeldoutSplitMismatch",
    "check_same_split",
    "split_group",
]

#: The project's split: a run config's `heldout_fraction` / `heldout_salt` defaults.
DEFAULT_HELDOUT_FRACTION = 0.25
DEFAULT_HELDOUT_SALT = "composer-replication"

# How many offending ids a HeldoutLeakError message lists before summarising the rest.
_MAX_IDS_IN_MESSAGE = 10


class HeldoutLeakError(ValueError):
    """A held-out task id reached a training or task-generation path.

    Attributes:
        task_ids: The offending held-out ids, in the order they were passed.
    """

    def __init__(self, task_ids: list[str]) -> None:
        self.task_ids = list(task_ids)
        shown = ", ".join(repr(t) for t in self.task_ids[:_MAX_IDS_IN_MESSAGE])
        more = len(self.task_ids) - _MAX_IDS_IN_MESSAGE
        if more > 0:
            shown += f" and {more} more"
        noun = "id" if len(self.task_ids) == 1 else "ids"
        super().__init__(
            f"held-out task {noun} {shown} passed to a training or task-generation path; "
            "held-out tasks may only be used for evaluation. Filter the ids with "
            "HeldoutSplit.filter_trainable() / train_ids() before building batches or "
            "generating tasks."
        )

    def __reduce__(self) -> tuple[type[HeldoutLeakError], tuple[list[str]]]:
        return (type(self), (self.task_ids,))


def split_group(task_id: str) -> str:
    """The part of ``task_id`` the split decides by: up to its first ``#``."""
    return task_id.split("#", 1)[0]


def _require_ids(task_ids: Iterable[str]) -> list[str]:
    # A bare str is iterable (its characters); that is always a caller bug here.
    if isinstance(task_ids, str):
        raise TypeError(
            f"expected an iterable of task ids, got the single string {task_ids!r}; "
            "wrap it in a list or use the single-id method"
        )
    ids = list(task_ids)
    for t in ids:
        _require_id(t)
    return ids


def _require_id(task_id: object) -> str:
    if not isinstance(task_id, str):
        raise TypeError(f"task ids must be str, got {task_id!r} ({type(task_id).__name__})")
    return task_id


@dataclass(frozen=True)
class HeldoutSplit:
    """Deterministic, disjoint split of task ids into train and held-out.

    Args:
        heldout_fraction: Expected fraction of ids held out, strictly between 0 and 1.
        salt: Mixed into the hash; a different salt gives an independent split. Keep it fixed
            for the life of a project, or previously held-out tasks leak into training.
    """

    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION
    salt: str = DEFAULT_HELDOUT_SALT

    def __post_init__(self) -> None:
        f = self.heldout_fraction
        if isinstance(f, bool) or not isinstance(f, numbers.Real) or not 0.0 < float(f) < 1.0:
            raise ValueError(f"heldout_fraction must be a number with 0 < fraction < 1, got {f!r}")
        if not isinstance(self.salt, str):
            raise TypeError(f"salt must be a str, got {self.salt!r}")
        object.__setattr__(self, "heldout_fraction", float(f))

    def bucket(self, task_id: str) -> float:
        """The id's stable pseudo-random position u in [0, 1); held out iff u < fraction."""
        group = split_group(_require_id(task_id))
        digest = hashlib.sha256(f"{self.salt}\x00{group}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2.0**64

    def is_heldout(self, task_id: str) -> bool:
        """True when `task_id` belongs to the held-out (evaluation-only) pool."""
        return self.bucket(task_id) < self.heldout_fraction

    def split(self, task_ids: Iterable[str]) -> tuple[list[str], list[str]]:
        """Return `(train, heldout)`, each in input order (duplicates kept)."""
        train: list[str] = []
        heldout: list[str] = []
        for t in _require_ids(task_ids):
            (heldout if self.is_heldout(t) else train).append(t)
        return train, heldout

    def train_ids(self, task_ids: Iterable[str]) -> list[str]:
        """The ids that may be trained on, in input order."""
        return self.split(task_ids)[0]

    def heldout_ids(self, task_ids: Iterable[str]) -> list[str]:
        """The evaluation-only ids, in input order."""
        return self.split(task_ids)[1]

    def filter_trainable(self, task_ids: Iterable[str]) -> list[str]:
        """Drop held-out ids silently (for samplers that draw from a mixed pool)."""
        return self.train_ids(task_ids)

    def check_trainable(self, task_ids: Iterable[str]) -> list[str]:
        """Return the ids as a list if none is held out; else raise `HeldoutLeakError`.

        Call at the boundary of every path that builds training batches or generates tasks.
        """
        ids = _require_ids(task_ids)
        leaked = [t for t in ids if self.is_heldout(t)]
        if leaked:
            raise HeldoutLeakError(leaked)
        return ids

    def assert_trainable(self, task_id: str) -> None:
        """Raise `HeldoutLeakError` if the single `task_id` is held out."""
        if self.is_heldout(task_id):
            raise HeldoutLeakError([task_id])

    def to_record(self) -> dict[str, object]:
        """What a task file records about the split it was made with."""
        return {"heldout_fraction": self.heldout_fraction, "salt": self.salt}

    @classmethod
    def from_record(cls, record: object, source: str = "split record") -> HeldoutSplit:
        """The split a task file recorded (`to_record`); `ValueError` naming `source` when
        the record is not one."""
        if not isinstance(record, dict) or set(record) != {"heldout_fraction", "salt"}:
            raise ValueError(
                f"{source}: expected {{'heldout_fraction': float, 'salt': str}}, got {record!r}"
            )
        return cls(record["heldout_fraction"], record["salt"])


class HeldoutSplitMismatch(ValueError):
    """Tasks were split with another fraction or salt than the run that wants them: some
    of their held-out tasks could be trained on (or the reverse)."""


def check_same_split(recorded: HeldoutSplit, run: HeldoutSplit, source: str) -> None:
    """Raise `HeldoutSplitMismatch` unless the tasks of `source` were split as `run` splits."""
    if recorded == run:
        return
    raise HeldoutSplitMismatch(
        f"{source} was split with heldout_fraction={recorded.heldout_fraction} and "
        f"salt={recorded.salt!r}, but this run splits with heldout_fraction="
        f"{run.heldout_fraction} and salt={run.salt!r}; set heldout_fraction = "
        f"{recorded.heldout_fraction} and heldout_salt = {recorded.salt!r} in the run config "
        "(or regenerate the tasks with the run's split)"
    )


#: The split in force wherever a task id is known and the caller names none.
DEFAULT_SPLIT = HeldoutSplit()
