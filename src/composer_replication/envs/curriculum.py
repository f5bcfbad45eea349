"""`DifficultyCurriculum`: sample the tasks the policy solves sometimes, not always or never.

With group-relative advantages (GRPO family, e.g. Dr.GRPO, arXiv 2503.20783) a task whose
group is all-correct or all-wrong has zero advantage for every sample: no learning signal.
The signal of a task solved with probability p scales with the Bernoulli variance p(1-p), so
the curriculum keeps a per-task pass-rate EMA and samples with weight p(1-p) inside a
configurable band, a small `outside_weight` outside it (the policy changes, so a
never-solved task can become learnable), and `unseen_weight` for tasks without any result.

Rounds: `update(round_idx, results)` is called once per round with strictly increasing
round indices; a repeated or older index raises `ValueError` (so a resumed run cannot
double-count a round). Sampling is deterministic given a seed or a `random.Random`.
Held-out tasks are refused at every entry point when a `HeldoutSplit` is given.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from composer_replication.safety.holdout import DEFAULT_SPLIT, HeldoutSplit

__all__ = ["DifficultyCurriculum"]

_STATE_VERSION = 1


def _pass_rate(task_id: str, value: float | Sequence[float]) -> float:
    values = [value] if isinstance(value, (int, float)) else list(value)
    if not values:
        raise ValueError(f"results for {task_id!r} are empty; pass a pass rate or rewards")
    for v in values:
        if isinstance(v, bool):
            continue
        if not isinstance(v, (int, float)) or math.isnan(v) or not 0.0 <= v <= 1.0:
            raise ValueError(f"results for {task_id!r} must be in [0, 1], got {v!r}")
    return sum(float(v) for v in values) / len(values)


class DifficultyCurriculum:
    """Per-task pass-rate EMA and weighted sampling toward the learnable band.

    Args:
        task_ids: Initial tasks (more with `add_tasks`).
        band: (low, high) pass rates that count as learnable, inclusive.
        ema_alpha: Weight on the PRIOR value: `ema = alpha*prev + (1-alpha)*rate`; the first
            result seeds the EMA. In [0, 1).
        unseen_weight: Sampling weight of a task with no result yet (0.25 = the largest
            p(1-p), so unseen tasks are tried early).
        outside_weight: Weight of a seen task outside the band.
        split: When given, held-out ids raise `HeldoutLeakError` everywhere.
    """

    def __init__(
        self,
        task_ids: Iterable[str] = (),
        *,
        band: tuple[float, float] = (0.05, 0.95),
        ema_alpha: float = 0.5,
        unseen_weight: float = 0.25,
        outside_weight: float = 0.01,
        split: HeldoutSplit | None = DEFAULT_SPLIT,
    ) -> None:
        low, high = band
        if not 0.0 <= low < high <= 1.0:
            raise ValueError(f"band must satisfy 0 <= low < high <= 1, got {band!r}")
        if not 0.0 <= ema_alpha < 1.0:
            raise ValueError(f"ema_alpha must be in [0, 1), got {ema_alpha!r}")
        if unseen_weight < 0 or outside_weight < 0:
            raise ValueError(
                f"weights must be >= 0, got unseen_weight={unseen_weight!r}, "
                f"outside_weight={outside_weight!r}"
            )
        self.band = (float(low), float(high))
        self.ema_alpha = float(ema_alpha)
        self.unseen_weight = float(unseen_weight)
        self.outside_weight = float(outside_weight)
        self.split = split
        self._ema: dict[str, float | None] = {}
        self._rounds: dict[str, int] = {}
        self.last_round: int | None = None
        self.add_tasks(task_ids)

    def _check(self, ids: Iterable[str]) -> list[str]:
        ids = list(ids)
        if self.split is not None:
            self.split.check_trainable(ids)
        bad = [t for t in ids if not isinstance(t, str)]
        if bad:
            raise TypeError(f"task ids must be str, got {bad!r}")
        return ids

    def add_tasks(self, task_ids: Iterable[str]) -> None:
        """Register tasks (already known ids are left unchanged)."""
        for task_id in self._check(task_ids):
            self._ema.setdefault(task_id, None)
            self._rounds.setdefault(task_id, 0)

    @property
    def tasks(self) -> list[str]:
        """Known task ids, sorted."""
        return sorted(self._ema)

    def update(self, round_idx: int, results: Mapping[str, float | Sequence[float]]) -> None:
        """Fold one round of results (pass rate, or rewards/booleans in [0, 1]) into the EMAs.

        Raises `ValueError` when `round_idx` is not greater than the last updated round, or
        for unknown task ids (call `add_tasks` first).
        """
        if isinstance(round_idx, bool) or not isinstance(round_idx, int):
            raise TypeError(f"round_idx must be an int, got {round_idx!r}")
        if self.last_round is not None and round_idx <= self.last_round:
            raise ValueError(
                f"update() already applied round {self.last_round}; got round {round_idx}. "
                "Call update() once per round with strictly increasing round indices"
            )
        ids = self._check(results)
        unknown = [t for t in ids if t not in self._ema]
        if unknown:
            raise ValueError(f"unknown task ids {unknown!r}; register them with add_tasks()")
        rates = {t: _pass_rate(t, results[t]) for t in ids}
        for task_id, rate in rates.items():
            prev = self._ema[task_id]
            self._ema[task_id] = (
                rate if prev is None else (self.ema_alpha * prev + (1.0 - self.ema_alpha) * rate)
            )
            self._rounds[task_id] += 1
        self.last_round = round_idx

    def pass_rate(self, task_id: str) -> float | None:
        """The task's pass-rate EMA; None before its first result."""
        return self._ema[task_id]

    def weight(self, task_id: str) -> float:
        """Sampling weight: p(1-p) in the band, `outside_weight` outside, floor when unseen."""
        p = self._ema[task_id]
        if p is None:
            return self.unseen_weight
        low, high = self.band
        if low <= p <= high:
            return max(p * (1.0 - p), 1e-6)
        return self.outside_weight

    def weights(self) -> dict[str, float]:
        """Weight of every task, keyed by id (sorted)."""
        return {t: self.weight(t) for t in self.tasks}

    def in_band(self) -> list[str]:
        """Seen tasks whose pass-rate EMA lies in the band, sorted."""
        low, high = self.band
        return [t for t in self.tasks if (p := self._ema[t]) is not None and low <= p <= high]

    def sample(
        self,
        n: int,
        *,
        seed: int | None = None,
        rng: random.Random | None = None,
        replace: bool = False,
    ) -> list[str]:
        """Draw `n` task ids by weight (deterministic for a given seed or generator).

        Without replacement this uses weighted random keys u**(1/w) (Efraimidis-Spirakis);
        zero-weight tasks are never drawn. When every weight is zero, draws are uniform.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        if rng is None:
            rng = random.Random(seed)
        ids = self.tasks
        weights = [self.weight(t) for t in ids]
        if not any(weights):
            weights = [1.0] * len(ids)
        if replace:
            if n and not ids:
                raise ValueError("cannot sample from an empty curriculum; add_tasks() first")
            return rng.choices(ids, weights=weights, k=n) if n else []
        positive = [(t, w) for t, w in zip(ids, weights) if w > 0]
        if n > len(positive):
            raise ValueError(
                f"cannot draw {n} distinct tasks: only {len(positive)} have weight > 0; "
                "pass replace=True or a smaller n"
            )
        keys = [(rng.random() ** (1.0 / w), t) for t, w in positive]
        keys.sort(key=lambda kt: kt[0], reverse=True)
        return [t for _, t in keys[:n]]

    def _settings(self) -> dict[str, Any]:
        return {
            "band": list(self.band),
            "ema_alpha": self.ema_alpha,
            "unseen_weight": self.unseen_weight,
            "outside_weight": self.outside_weight,
        }

    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot (settings, last round, per-task EMA and round count)."""
        return {
            "version": _STATE_VERSION,
            **self._settings(),
            "last_round": self.last_round,
            "tasks": {t: {"ema": self._ema[t], "rounds": self._rounds[t]} for t in self.tasks},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict()`; its settings must equal this curriculum's."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"unsupported curriculum state version {state.get('version')!r}; "
                f"expected {_STATE_VERSION}"
            )
        saved = {k: state[k] for k in self._settings()}
        if saved != self._settings():
            raise ValueError(
                f"state was saved with settings {saved}, this curriculum has "
                f"{self._settings()}; construct it with the same settings"
            )
        tasks = state["tasks"]
        self._check(tasks)
        self._ema = {t: (None if v["ema"] is None else float(v["ema"])) for t, v in tasks.items()}
        self._rounds = {t: int(v["rounds"]) for t, v in tasks.items()}
        self.last_round = state["last_round"]
