"""What every environment shares: the ``Environment`` protocols (defined with the other
roles in :mod:`composer_replication.roles`, re-exported here) and pass@1 over groups.

An environment owns its tasks (ids, prompts, verifiers) and runs attempts at them: it
samples completions with the policy (single- or multi-turn, tools executed in a sandbox),
scores each attempt, and returns one group of rollouts per task. A failed attempt is data:
it comes back as a ``Rollout`` with ``error`` set and reward 0, never as an exception.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from composer_replication.roles import DemonstratingEnvironment, Environment, SplitEnvironment

if TYPE_CHECKING:
    from composer_replication.samples.rollouts import Rollout

__all__ = ["DemonstratingEnvironment", "Environment", "SplitEnvironment", "pass_at_1"]


def pass_at_1(groups: Sequence[Sequence[Rollout]]) -> float:
    """Share of attempts that fully solved their task (reward 1.0), over all groups.

    Attempts whose sandbox failed before they ran (``infrastructure_error``) say nothing
    about the policy and are left out.
    """
    attempts = [r for group in groups for r in group if not r.infrastructure_error]
    if not attempts:
        return 0.0
    return sum(1 for r in attempts if r.reward >= 1.0) / len(attempts)
