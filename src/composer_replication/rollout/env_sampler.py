"""Each environment's Sampler: where its rollouts come from, whether that is the live
policy, and the arguments they are sampled with.

One per ``[[envs]]`` entry (``training.runtime.EnvRuntime.sampler``), built from its
``sampling`` config. It owns the entry's rollout source: the live policy (whatever samples
it in this run, the model in process, the inference engine or a Monarch generator's copy,
handed in per call) or a frozen pool it holds (a frozen endpoint, a frozen local model, the
environment's reference solutions). What liveness implies is decided here, not in the loop:

- the sampling arguments (:meth:`EnvSampler.sampling_args`): a frozen source is asked for
  no log-probs (its samples train only non-rl components, which do not read them);
- the rollouts' provenance (:meth:`EnvSampler.rollouts`): a frozen source's rollouts are
  marked (``Rollout.from_frozen_source``) and carry no policy version; a frozen sampler
  does not change with policy updates, so they never go stale, and the staleness bound of
  sampling ahead (``training.rollout_queue.drop_stale``) never drops them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from composer_replication.roles import DemonstratingEnvironment, SplitEnvironment
from composer_replication.rollout.demonstrations import ReferenceSolutions
from composer_replication.samples.generation import SamplingSettings
from composer_replication.samples.rollouts import Rollout, mark_frozen_source

if TYPE_CHECKING:
    from composer_replication.config.algorithm import SamplingConfig
    from composer_replication.roles import Environment, Sampler

__all__ = ["EnvSampler"]


@dataclass(frozen=True)
class EnvSampler:
    """One environment's rollout source and sampling arguments.

    Attributes:
        settings: temperature and answer budget of its rollouts.
        group_size: rollouts per task.
        source: its frozen pool (a frozen :class:`~composer_replication.roles.Sampler`
            or :class:`ReferenceSolutions`), or None when the live policy samples.
    """

    settings: SamplingSettings
    group_size: int
    source: Sampler | ReferenceSolutions | None = None

    @classmethod
    def from_config(cls, sampling: SamplingConfig) -> EnvSampler:
        """The sampler of a ``sampling`` config (a frozen source is loaded or connected
        here: a local model is read now, an endpoint is only addressed)."""
        from composer_replication.rollout.endpoint_sampler import frozen_source

        return cls(
            settings=SamplingSettings(
                max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature
            ),
            group_size=sampling.group_size,
            source=None if sampling.source == "policy" else frozen_source(sampling.source),
        )

    @property
    def samples_from_live_policy(self) -> bool:
        """Whether its rollouts come from the policy being trained."""
        if self.source is None:
            return True
        if isinstance(self.source, ReferenceSolutions):
            return False
        return self.source.samples_from_live_policy

    def sampling_args(self) -> SamplingSettings:
        """The settings its rollouts are sampled with: a frozen source is asked for no
        log-probs."""
        if self.samples_from_live_policy:
            return self.settings
        return replace(self.settings, logprobs=False)

    def pool(self, live: Sampler) -> Sampler | ReferenceSolutions:
        """What samples its rollouts: ``live`` (the live policy's sampler in this process)
        or its frozen source."""
        return live if self.source is None else self.source

    def rollouts(
        self,
        env: Environment,
        live: Sampler,
        tokenizer: Any,
        task_ids: Sequence[str],
        *,
        graded: bool = True,
    ) -> list[list[Rollout]]:
        """One group of ``group_size`` rollouts per task id of ``env``, in order, sampled
        by :meth:`pool` with :meth:`sampling_args`; a frozen source's are marked
        (:func:`~composer_replication.samples.rollouts.mark_frozen_source`). ``graded=False``:
        the sampling half only (``env`` a ``SplitEnvironment``, graded elsewhere)."""
        if isinstance(self.source, ReferenceSolutions):  # demonstrations: nothing sampled
            if not isinstance(env, DemonstratingEnvironment):
                raise ValueError(f"environment {env.name!r} gives no reference solutions")
            groups = env.demonstrations(tokenizer, task_ids, group_size=self.group_size)
            for group in groups:
                for rollout in group:
                    mark_frozen_source(rollout)
            return groups
        run = env.rollouts
        if not graded:
            if not isinstance(env, SplitEnvironment):
                raise ValueError(f"environment {env.name!r} grades inside its rollouts")
            run = env.sample
        groups = run(
            self.pool(live),
            tokenizer,
            task_ids,
            group_size=self.group_size,
            sampling=self.sampling_args(),
        )
        if not self.samples_from_live_policy:
            for group in groups:
                for rollout in group:
                    mark_frozen_source(rollout)
        return groups
