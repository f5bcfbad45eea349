"""``custom``: per-token advantages from a user function named by import path.

``fn(inputs: AdvantageInputs, **kwargs) -> list[list[float]]``: ``inputs`` is one group (the
rollouts of one task), and the function returns one list per rollout aligned to
``inputs.completion_lengths`` (one value per completion token, observation tokens included;
their values are replaced by 0.0, as the trainer masks them anyway).
``inputs.broadcast(values)`` spreads one value per rollout over its completion tokens, for
uniform group credit. ``AdvantageInputs`` is also the sequence of the group's rollouts, so a
function written as ``fn(group, **kwargs)`` over the list of rollouts works unchanged.
Wrong shapes or non-finite values raise ``UsageError`` (a ``ValueError``) naming the rollout;
an exception of the function is one line naming its import path. Component: ``rl``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

from composer_replication.algo.base import Algorithm, on_completion, one_per_rollout
from composer_replication.common.callables import load_callable
from composer_replication.common.errors import UsageError, user_code_error
from composer_replication.config.advantage import CustomAdvantage
from composer_replication.samples.rollouts import Rollout
from composer_replication.samples.wire import TrainingSample


@dataclass(frozen=True)
class AdvantageInputs(Sequence[Rollout]):
    """What a custom advantage function gets: one group of rollouts (one task).

    Also a read-only sequence of those rollouts (``len``, indexing, iteration).
    """

    rollouts: tuple[Rollout, ...]

    def __init__(self, rollouts: Sequence[Rollout]) -> None:
        object.__setattr__(self, "rollouts", tuple(rollouts))

    @property
    def rewards(self) -> list[float]:
        """Each rollout's reward, in order."""
        return [float(r.reward) for r in self.rollouts]

    @property
    def completion_lengths(self) -> list[int]:
        """Each rollout's number of completion tokens: the length its advantages must have."""
        return [len(r.completion_ids) for r in self.rollouts]

    def broadcast(self, values: Sequence[float]) -> list[list[float]]:
        """One value per rollout, repeated over that rollout's completion tokens.

        Raises:
            ValueError: ``values`` does not have one entry per rollout.
        """
        values = list(values)
        if len(values) != len(self.rollouts):
            raise ValueError(
                f"broadcast needs one value per rollout of the group: got {len(values)} values "
                f"for {len(self.rollouts)} rollouts"
            )
        return [[float(v)] * n for v, n in zip(values, self.completion_lengths)]

    def __len__(self) -> int:
        return len(self.rollouts)

    @overload
    def __getitem__(self, index: int) -> Rollout: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Rollout, ...]: ...

    def __getitem__(self, index: int | slice) -> Rollout | tuple[Rollout, ...]:
        return self.rollouts[index]

    def __iter__(self) -> Iterator[Rollout]:
        return iter(self.rollouts)


class CustomAlgorithm(Algorithm):
    """Advantages from ``advantage.import_path`` called with ``advantage.kwargs``."""

    config_class = CustomAdvantage

    def __init__(self, config: Any, fn: Any = None) -> None:
        super().__init__(config)
        cfg = self.advantage_config
        self.fn = fn or load_callable(cfg.import_path, "custom advantage")

    def finalize_group(
        self, group: list[Rollout], samples: list[TrainingSample]
    ) -> list[TrainingSample]:
        cfg = self.advantage_config
        pairs = one_per_rollout(group, samples)
        try:
            values = list(self.fn(AdvantageInputs(group), **cfg.kwargs))
        except Exception as err:  # the user's code: blame it, in one line
            raise user_code_error(
                f"custom advantage {cfg.import_path}",
                err,
                "it is called as fn(inputs: AdvantageInputs, **advantage.kwargs) and returns "
                "one per-token list per rollout",
            ) from err
        if len(values) != len(group):
            raise UsageError(
                f"custom advantage {cfg.import_path}: returned {len(values)} lists for a group "
                f"of {len(group)} rollouts; return one per-token list per rollout"
            )
        for i, ((rollout, sample), per_token) in enumerate(zip(pairs, values)):
            try:
                per_token = [float(v) for v in per_token]
            except (TypeError, ValueError) as err:
                raise UsageError(
                    f"custom advantage {cfg.import_path}: rollout {i} ({rollout.task_id!r}): "
                    f"its advantages are not numbers ({err}); return one list of floats per "
                    "rollout"
                ) from None
            n = len(rollout.completion_ids)
            if len(per_token) != n:
                raise UsageError(
                    f"custom advantage {cfg.import_path}: rollout {i} ({rollout.task_id!r}) has "
                    f"{n} completion tokens but {len(per_token)} advantages; return one value "
                    "per completion token"
                )
            bad = [j for j, v in enumerate(per_token) if not math.isfinite(v)]
            if bad:
                raise UsageError(
                    f"custom advantage {cfg.import_path}: rollout {i} ({rollout.task_id!r}) has "
                    f"non-finite advantages at completion tokens {bad[:5]}"
                )
            masked = [v if m else 0.0 for v, m in zip(per_token, rollout.completion_mask or ())]
            sample.advantages = on_completion(rollout, masked)
        return samples


def reward_per_token(inputs: AdvantageInputs, *, scale: float = 1.0) -> list[list[float]]:
    """Example advantage function: ``scale * reward`` on every completion token."""
    return inputs.broadcast([scale * r for r in inputs.rewards])
