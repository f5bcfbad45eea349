"""``custom``: per-token advantages from a user function named by import path.

``fn(group, **kwargs) -> list[list[float]]``: one list per rollout, one value per
completion token (observation tokens included; their values are replaced by 0.0, as the
trainer masks them anyway). Wrong shapes or non-finite values raise ``ValueError`` naming the rollout.
Component: ``rl``.
"""

from __future__ import annotations

import math
from typing import Any

from composer_replication.algo.base import (
    Algorithm,
    check_group,
    load_callable,
    on_completion,
    rollout_to_sample,
)
from composer_replication.rollout.types import Rollout
from composer_replication.wire import TrainingSample


class CustomAlgorithm(Algorithm):
    """Advantages from ``advantage.import_path`` called with ``advantage.kwargs``."""

    name = "custom"
    components = ("rl",)

    def __init__(self, config: Any, fn: Any = None) -> None:
        super().__init__(config)
        cfg = self.advantage_config
        self.fn = fn or load_callable(cfg.import_path, "custom advantage")

    def assign(self, group: list[Rollout]) -> list[TrainingSample]:
        check_group(group, self.name)
        cfg = self.advantage_config
        values = list(self.fn(group, **cfg.kwargs))
        if len(values) != len(group):
            raise ValueError(
                f"custom advantage {cfg.import_path}: returned {len(values)} lists for a group "
                f"of {len(group)} rollouts; return one per-token list per rollout"
            )
        samples = []
        for i, (rollout, per_token) in enumerate(zip(group, values)):
            per_token = [float(v) for v in per_token]
            n = len(rollout.completion_ids)
            if len(per_token) != n:
                raise ValueError(
                    f"custom advantage {cfg.import_path}: rollout {i} ({rollout.task_id!r}) has "
                    f"{n} completion tokens but {len(per_token)} advantages; return one value "
                    "per completion token"
                )
            bad = [j for j, v in enumerate(per_token) if not math.isfinite(v)]
            if bad:
                raise ValueError(
                    f"custom advantage {cfg.import_path}: rollout {i} ({rollout.task_id!r}) has "
                    f"non-finite advantages at completion tokens {bad[:5]}"
                )
            masked = [v if m else 0.0 for v, m in zip(per_token, rollout.completion_mask or ())]
            sample = rollout_to_sample(rollout, source=self.name)
            sample.advantages = on_completion(rollout, masked)
            samples.append(sample)
        return samples


def reward_per_token(group: list[Rollout], *, scale: float = 1.0) -> list[list[float]]:
    """Example advantage function: ``scale * reward`` on every completion token."""
    return [[scale * r.reward] * len(r.completion_ids) for r in group]
