"""Filters over one group's training samples, between ``process_group`` and scoring/packing.

The truncation filter (``TruncationFilter``): agent episodes cut short by a budget are
trained as the failures they scored (``keep``), left out of the rl loss while still in
their group's baseline (``mask``, DAPO's overlong filtering, arXiv 2503.14476), or
penalised before the group is processed (``penalize``).

The zero-advantage filter: a group whose advantage streams are all zero (every rollout of
a group-relative algorithm earned the same reward) gives the ``rl`` component no policy
gradient, yet its tokens would still cost a forward pass and count in the rl mean's token
denominator, shrinking the gradient of the groups that do learn (DAPO's dynamic sampling
drops such groups for the same reason, arXiv 2503.14476). Only the rl part is left out:

- a sample that trains nothing else is dropped;
- a sample that also carries another component (ce, ref_kl or jsd weight, a dpo pair)
  stays, with its rl weights set to 0, so no non-rl signal is lost;
- samples without rl credit (``advantages`` None: opd, opsd, sft, pair-only samples)
  never make a group zero-advantage and are never touched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from composer_replication.samples.wire import TrainingSample

#: Per-token weight streams of the components other than rl.
OTHER_COMPONENT_STREAMS = ("ce_weights", "ref_kl_weights", "jsd_weights")


def live_rl_advantages(sample: TrainingSample) -> list[float]:
    """The advantages on the tokens the rl component trains (trainable, rl weight != 0)."""
    if sample.advantages is None:
        return []
    weights = sample.rl_weights or [1.0] * len(sample.loss_mask)
    return [a for a, m, w in zip(sample.advantages, sample.loss_mask, weights) if m and w != 0]


def has_rl_credit(sample: TrainingSample) -> bool:
    """Whether ``sample`` trains the rl component (advantages and live rl tokens)."""
    return sample.advantages is not None and sample.n_live_rl_tokens > 0


def is_zero_advantage_group(samples: Sequence[TrainingSample]) -> bool:
    """Whether a group's samples carry rl credit, and all of it is zero."""
    rl = [s for s in samples if has_rl_credit(s)]
    return bool(rl) and all(a == 0 for s in rl for a in live_rl_advantages(s))


def carries_other_signal(sample: TrainingSample) -> bool:
    """Whether ``sample`` trains a component other than rl (a weight or a dpo pair)."""
    if sample.dpo is not None:
        return True
    return any(any(w != 0 for w in getattr(sample, name) or ()) for name in OTHER_COMPONENT_STREAMS)


def without_rl(sample: TrainingSample) -> TrainingSample:
    """A copy of ``sample`` whose rl weights are all 0 (its other components unchanged)."""
    return dataclasses.replace(sample, rl_weights=[0.0] * sample.n_tokens)


class ZeroAdvantageFilter:
    """Leaves the rl part of zero-advantage groups out of a step's samples and counts it.

    Call it on each group's samples (``algorithm.process_group(group)``); :meth:`metrics`
    gives the step's counts: ``rollouts/zero_advantage`` (samples with rl credit in
    zero-advantage groups, counted with ``enforce`` off too) and
    ``rollouts/zero_advantage_dropped`` (samples left out of the batch entirely).
    """

    def __init__(self, *, enforce: bool = True) -> None:
        self.enforce = enforce
        self.detected = 0
        self.dropped = 0

    def __call__(self, group_samples: Sequence[TrainingSample]) -> list[TrainingSample]:
        samples = list(group_samples)
        if not is_zero_advantage_group(samples):
            return samples
        self.detected += sum(1 for s in samples if has_rl_credit(s))
        if not self.enforce:
            return samples
        kept = []
        for sample in samples:
            if not has_rl_credit(sample):
                kept.append(sample)
            elif carries_other_signal(sample):
                kept.append(without_rl(sample))
            else:
                self.dropped += 1
        return kept

    def metrics(self) -> dict[str, float]:
        return {
            "rollouts/zero_advantage": float(self.detected),
            "rollouts/zero_advantage_dropped": float(self.dropped),
        }


class TruncationFilter:
    """What a step does with agent episodes cut short by a budget (``[filters.truncated]``).

    :meth:`penalize` runs on a group's rollouts before ``process_group`` (``penalize``:
    their reward drops by ``penalty``, the original kept in
    ``metadata["reward_before_truncation"]``); :meth:`__call__` on its samples after it
    (``mask``: the rl part of samples marked ``metadata["truncated"]`` leaves the batch, the
    rest as the zero-advantage filter does). :meth:`metrics`: ``rollouts/truncated`` (cut
    short episodes seen) and ``rollouts/truncated_masked`` (samples whose rl left).
    """

    def __init__(self, *, mode: str = "keep", penalty: float = 0.5) -> None:
        if mode not in ("keep", "mask", "penalize"):
            raise ValueError(f"truncated filter mode {mode!r}: use keep, mask or penalize")
        self.mode = mode
        self.penalty = float(penalty)
        self.seen = 0
        self.masked = 0

    def penalize(self, group: Sequence[Any]) -> None:
        for rollout in group:
            if not rollout.truncated:
                continue
            self.seen += 1
            if self.mode == "penalize":
                rollout.metadata["reward_before_truncation"] = rollout.reward
                rollout.reward = rollout.reward - self.penalty

    def __call__(self, group_samples: Sequence[TrainingSample]) -> list[TrainingSample]:
        if self.mode != "mask":
            return list(group_samples)
        kept = []
        for sample in group_samples:
            if not sample.metadata.get("truncated") or not has_rl_credit(sample):
                kept.append(sample)
                continue
            self.masked += 1
            if carries_other_signal(sample):
                kept.append(without_rl(sample))
        return kept

    def metrics(self) -> dict[str, float]:
        return {
            "rollouts/truncated": float(self.seen),
            "rollouts/truncated_masked": float(self.masked),
        }
