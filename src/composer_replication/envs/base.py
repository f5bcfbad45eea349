"""The ``Environment`` protocol: tasks in, groups of scored rollouts out.

An environment owns its tasks (ids, prompts, verifiers) and runs attempts at them: it
samples completions with the policy (single- or multi-turn, tools executed in a sandbox),
scores each attempt, and returns one group of rollouts per task. A failed attempt is data:
it comes back as a ``Rollout`` with ``error`` set and reward 0, never as an exception.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from composer_replication.inference.decoding.generate import SamplingSettings
from composer_replication.rollout.types import Rollout

if TYPE_CHECKING:
    from composer_replication.roles import Sampler


@runtime_checkable
class Environment(Protocol):
    """What the training loop needs from an environment."""

    name: str

    def task_ids(self) -> list[str]:
        """Every task id this environment can run (train and held-out alike)."""
        ...

    def rollouts(
        self,
        sampler: Sampler,
        tokenizer: Any,
        task_ids: Sequence[str],
        *,
        group_size: int,
        sampling: SamplingSettings,
    ) -> list[list[Rollout]]:
        """``group_size`` scored attempts per task sampled by ``sampler``, one group per
        task id, in order."""
        ...


@runtime_checkable
class SplitEnvironment(Environment, Protocol):
    """A single-turn environment that samples and grades in separate calls (so sampling
    and grading can run in different processes); it is its own
    :class:`~composer_replication.roles.Grader`."""

    def sample(
        self,
        sampler: Sampler,
        tokenizer: Any,
        task_ids: Sequence[str],
        *,
        group_size: int,
        sampling: SamplingSettings,
    ) -> list[list[Rollout]]:
        """The sampling half of ``rollouts``: ungraded groups, one per task id, in order."""
        ...

    def grade_groups(self, groups: Sequence[Sequence[Rollout]]) -> list[list[Rollout]]:
        """The grading half: ``groups`` with rewards, feedback and errors filled in."""
        ...


@runtime_checkable
class DemonstratingEnvironment(Environment, Protocol):
    """An environment that answers its tasks with reference solutions (the samples of
    ``sampling.source = "reference"``)."""

    def demonstrations(
        self, tokenizer: Any, task_ids: Sequence[str], *, group_size: int = 1
    ) -> list[list[Rollout]]:
        """Each task's prompt answered with its reference solution, one group per task."""
        ...


def pass_at_1(groups: Sequence[Sequence[Rollout]]) -> float:
    """Share of attempts that fully solved their task (reward 1.0), over all groups.

    Attempts whose sandbox failed before they ran (``infrastructure_error``) say nothing
    about the policy and are left out.
    """
    attempts = [r for group in groups for r in group if not r.infrastructure_error]
    if not attempts:
        return 0.0
    return sum(1 for r in attempts if r.reward >= 1.0) / len(attempts)
