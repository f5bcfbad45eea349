"""Rollouts: generation with the policy and the records it produces."""

from composer_replication.rollout.types import Rollout

__all__ = ["Rollout"]
