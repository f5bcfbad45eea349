"""This process's place among a run's training ranks, for what the run lifecycle shares.

One process is rank 0 of 1 and every method is the identity. Under ``torchrun`` (the native
loop's data parallelism) or ``accelerate launch`` (the trl backend), where
``torch.distributed`` is initialised, the lifecycle uses :class:`RankGroup` to:

- let rank 0 alone write the run directory (config, metrics, report, final model, summary);
- split held-out evaluation across the ranks and gather every group back, in task order, on
  every rank (so every rank computes the same scores);
- make every stop decision rank 0's (the kill switch must end all ranks together, or the
  others would wait forever in their next collective).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["RankGroup"]


@dataclass(frozen=True)
class RankGroup:
    """``rank`` of ``world_size`` processes; collectives go through torch.distributed."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank {self.rank} of world size {self.world_size}: need 0 <= rank < world_size"
            )

    @classmethod
    def current(cls) -> RankGroup:
        """The initialised default process group's view, or rank 0 of 1 without one."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    @property
    def is_writer(self) -> bool:
        """Whether this process writes the run's files (rank 0)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def share(self, items: Sequence[T]) -> list[T]:
        """This rank's items: every ``world_size``-th, starting at ``rank`` (balanced)."""
        return list(items[self.rank :: self.world_size])

    def gather_shares(self, mine: Sequence[T], total: int) -> list[T]:
        """Every rank's :meth:`share` results back in the original order, on every rank.

        ``mine`` holds one result per item of this rank's share; ``total`` is the length of
        the sequence that was shared.
        """
        if len(mine) != len(range(self.rank, total, self.world_size)):
            raise ValueError(
                f"rank {self.rank} holds {len(mine)} results for its share of {total} items"
            )
        if not self.distributed:
            return list(mine)
        import torch.distributed as dist

        shares: list[Any] = [None] * self.world_size
        dist.all_gather_object(shares, list(mine))
        merged: list[Any] = [None] * total
        for rank, results in enumerate(shares):
            merged[rank :: self.world_size] = results
        return merged

    def union(self, mine: dict[str, T]) -> dict[str, T]:
        """Every rank's entries merged, on every rank (keys are disjoint: each rank's share)."""
        if not self.distributed:
            return dict(mine)
        import torch.distributed as dist

        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, dict(mine))
        merged: dict[str, T] = {}
        for part in parts:
            merged.update(part)
        return merged

    def agree(self, value: T) -> T:
        """Rank 0's ``value`` on every rank (one decision for the whole run)."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def first_set(self, value: T | None) -> T | None:
        """The lowest rank's ``value`` that is not None, on every rank (None when no rank
        has one): a condition any rank may raise, decided the same everywhere."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        box: list[T | None] = [None] * self.world_size
        dist.all_gather_object(box, value)
        return next((v for v in box if v is not None), None)

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()
