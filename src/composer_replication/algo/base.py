"""The ``Algorithm`` interface: rollouts compiled, in stages, into per-token weight streams.

An algorithm turns finished rollouts into training samples: per-token weight streams on
the trainer's fixed loss components (``rl``, ``ce``, ``ref_kl``, ``jsd``, ``dpo``). The
compilation runs in stages. Each stage is a hook a subclass overrides; the base class
drives them, and the pipeline calls only its two drivers, never a hook:

- ``process_group(group)``, at group time: ``check_group(group)`` (what groups it accepts;
  default non-empty, one task) -> ``build_samples(rollout)`` for each rollout (the Rollout ->
  TrainingSample conversion; observation tokens weighted by ``observation_weights``) ->
  ``finalize_group(group, samples)`` (group-level credit: advantages, anything that
  compares siblings; default: the samples unchanged).
- ``async score(batch)``, at ship time (after filtering): ``score_samples(samples)`` (fill
  what needs a model, e.g. reference log-probs; default nothing) over the batch in chunks
  of ``scoring_chunk_size``, at most ``max_concurrent_scoring`` chunks in flight.

Frozen models an algorithm scores with (an opd teacher, the opsd reference, the DPO
reference) are declared on its class (``frozen_pools``: :class:`FrozenPool`), never built
by the algorithm: ``build`` constructs it (``from_resources``), then ``setup(resources)``
connects each declared pool with ``connect_frozen_pool(name, pool)``, from a scorer the
run hands over or from the model the config names; ``connected_pools`` holds them.
Other resources (tokenizer, pairs, rng) an algorithm takes in ``from_resources`` from
:class:`AlgorithmResources`. The loss settings and the jsd teacher it requires are
declared by its config (``AdvantageConfig.loss_requirements`` / ``teacher_mode``) and
resolved when the run config is validated: the trainer never branches on an algorithm's
name.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from composer_replication.algo.advantage import align_prefill_logprobs
from composer_replication.algo.scoring import LocalPrefillScorer, scorer_for
from composer_replication.samples.rollouts import Rollout
from composer_replication.samples.wire import TrainingSample

if TYPE_CHECKING:
    import random

    from composer_replication.algo.scoring import PrefillScorer
    from composer_replication.config.advantage import _Advantage
    from composer_replication.config.algorithm import AlgorithmConfig

# Sample metadata keys of a pending reference-log-prob request (set at group time, used by
# score).
REF_CONTEXT = "ref_context_ids"
REF_INDEX = "ref_context_index"


@dataclass
class AlgorithmResources:
    """What ``build_algorithm`` hands an algorithm class; each takes what it needs.

    Attributes:
        tokenizer: the policy's tokenizer.
        scorer: a ready frozen pool declared ``given_as="scorer"`` (the opd teacher / opsd
            reference); without one it is built from the config's model.
        reference_scorer: a ready frozen pool declared ``given_as="reference_scorer"`` (the
            DPO reference; None: the trainer's reference model fills those log-probs).
        pairs: preference pairs, overriding ``advantage.pairs_path``.
        rng: randomness of pair sampling.
        policy: the live policy, for references that are the policy itself.
        temperature: sampling temperature of in-process scoring.
    """

    tokenizer: Any = None
    scorer: PrefillScorer | None = None
    reference_scorer: PrefillScorer | None = None
    pairs: Sequence[Any] | None = None
    rng: random.Random | None = None
    policy: Any = None
    temperature: float = 1.0


@dataclass(frozen=True)
class FrozenPool:
    """A frozen model pool an algorithm scores with, declared in ``Algorithm.frozen_pools``.

    ``Algorithm.setup`` connects it from, in order: the resource ``given_as`` names; the
    model the advantage config's ``model_field`` names (an endpoint or a local model, see
    :func:`~composer_replication.algo.scoring.scorer_for`; ``"policy"``: the live policy
    scoring in process).

    Attributes:
        name: its key in ``Algorithm.connected_pools`` ("teacher", "reference", ...).
        given_as: the :class:`AlgorithmResources` field (the ``build_algorithm`` argument)
            that hands a ready scorer over: "scorer" or "reference_scorer".
        model_field: the advantage-config field naming the model that serves it; None when
            only ``given_as`` supplies it.
        error_if_missing: the one-line error when no source gives the pool; None makes it
            optional (left unconnected).
    """

    name: str
    given_as: str
    model_field: str | None = None
    error_if_missing: str | None = None


class Algorithm:
    """One algorithm: rollouts in, training samples out, through the hooks above.

    A subclass names its config class (``config_class``: an advantage config, which
    declares what the algorithm trains, whether it is group-relative and which backends run
    it); ``name`` (the built-in ``type``, else ``"module:Class"``) and ``components`` (the
    config's ``trains``) follow from it. A user's algorithm is a subclass whose
    ``config_class`` subclasses :class:`~composer_replication.config.advantage.UserAdvantage`,
    named by import path in the run config (``type = "package.module:Class"``).
    """

    config_class: ClassVar[type[_Advantage]]
    name: ClassVar[str]
    #: the loss components its samples carry weights for: ``config_class.trains``
    components: ClassVar[tuple[str, ...]]
    #: the frozen model pools it scores with (connected by ``setup``)
    frozen_pools: ClassVar[tuple[FrozenPool, ...]] = ()
    #: ``score_samples`` calls in flight at once; an endpoint scorer also bounds the
    #: requests of each call (``EndpointPrefillScorer.max_concurrency``)
    max_concurrent_scoring: ClassVar[int] = 4
    #: samples per ``score_samples`` call (a local scorer's prefill batch is 8 sequences)
    scoring_chunk_size: ClassVar[int] = 8

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        config_class = cls.__dict__.get("config_class")
        if config_class is None:
            return  # an abstract base, or a subclass keeping its parent's config
        declared = tuple(config_class.trains)
        own = cls.__dict__.get("components")
        if own is not None and tuple(own) != declared:
            raise TypeError(
                f"{cls.__name__}.components = {tuple(own)} but its config "
                f"{config_class.__name__} declares trains = {declared}; declare them once, "
                "on the config (leave components out)"
            )
        cls.components = declared
        if "name" not in cls.__dict__:
            builtin = config_class.model_fields["type"].default
            cls.name = builtin if isinstance(builtin, str) else f"{cls.__module__}:{cls.__name__}"

    def __init__(self, config: AlgorithmConfig) -> None:
        if getattr(type(self), "config_class", None) is None:
            raise TypeError(
                f"{type(self).__name__} declares no config_class; name its advantage config "
                "class (a UserAdvantage subclass for a user's algorithm)"
            )
        if not isinstance(config.advantage, self.config_class):
            raise ValueError(
                f"{type(self).__name__} needs advantage.type = {self.name!r} (a "
                f"{self.config_class.__name__}), got {config.advantage.type!r}; use "
                "build_algorithm(config)"
            )
        self.config = config
        self.connected_pools: dict[str, PrefillScorer] = {}

    # ------------------------------------------------------------------ construction

    @classmethod
    def build(cls, config: AlgorithmConfig, resources: AlgorithmResources) -> Algorithm:
        """Construct from a config and the run's resources, then connect its frozen pools."""
        algorithm = cls.from_resources(config, resources)
        algorithm.setup(resources)
        return algorithm

    @classmethod
    def from_resources(cls, config: AlgorithmConfig, resources: AlgorithmResources) -> Algorithm:
        """The algorithm with the resources it takes besides its frozen pools (override to
        take some: a tokenizer, pairs). Default: ``cls(config)``."""
        return cls(config)

    def setup(self, resources: AlgorithmResources) -> None:
        """Connect every declared frozen pool not yet connected (see :class:`FrozenPool`).

        Raises:
            ValueError: a required pool has no source (its ``error_if_missing``).
        """
        for spec in self.frozen_pools:
            if spec.name in self.connected_pools:
                continue
            pool = self._pool_source(spec, resources)
            if pool is not None:
                self.connect_frozen_pool(spec.name, pool)
            elif spec.error_if_missing is not None:
                raise ValueError(spec.error_if_missing)

    def _pool_source(self, spec: FrozenPool, resources: AlgorithmResources) -> Any:
        given = getattr(resources, spec.given_as)
        if given is not None or spec.model_field is None:
            return given
        model = getattr(self.advantage_config, spec.model_field)
        if model == "policy":
            if resources.policy is None:
                return None
            return LocalPrefillScorer(resources.policy, temperature=resources.temperature)
        return scorer_for(model)

    def connect_frozen_pool(self, name: str, pool: PrefillScorer) -> None:
        """Connect ``pool`` as the frozen pool ``name`` (one its class declares)."""
        declared = [spec.name for spec in self.frozen_pools]
        if name not in declared:
            raise ValueError(
                f"{self.name} declares the frozen pools {declared}, not {name!r}; connect one "
                "of those"
            )
        self.connected_pools[name] = pool

    def frozen_pool(self, name: str) -> PrefillScorer:
        """The connected frozen pool ``name``.

        Raises:
            ValueError: it is not connected (build with ``build_algorithm``, or call
                ``connect_frozen_pool``).
        """
        if name not in self.connected_pools:
            raise ValueError(
                f"{self.name}: the frozen pool {name!r} is not connected; build the algorithm "
                f"with build_algorithm(...) or call connect_frozen_pool({name!r}, scorer)"
            )
        return self.connected_pools[name]

    @property
    def advantage_config(self) -> Any:
        """``config.advantage``, the algorithm's own settings."""
        return self.config.advantage

    # ------------------------------------------------------------------ drivers

    def process_group(self, group: list[Rollout]) -> list[TrainingSample]:
        """Training samples of one finished group: ``check_group``, ``build_samples`` per
        rollout (in order), ``finalize_group``. The one call the pipeline makes at group
        time."""
        self.check_group(group)
        samples = [sample for rollout in group for sample in self.build_samples(rollout)]
        return self.finalize_group(group, samples)

    def assign(self, group: list[Rollout]) -> list[TrainingSample]:
        """Group finalisation under its first public name: ``process_group(group)``."""
        return self.process_group(group)

    async def score(self, batch: list[TrainingSample]) -> None:
        """Ship time: ``score_samples`` over ``batch`` in chunks of ``scoring_chunk_size``,
        at most ``max_concurrent_scoring`` chunks in flight. Fills the samples in place."""
        size, limit = self.scoring_chunk_size, self.max_concurrent_scoring
        if size < 1 or limit < 1:
            raise ValueError(
                f"{self.name}: scoring_chunk_size = {size} and max_concurrent_scoring = "
                f"{limit} must both be >= 1"
            )
        gate = asyncio.Semaphore(limit)

        async def score_chunk(chunk: list[TrainingSample]) -> None:
            async with gate:
                await self.score_samples(chunk)

        await asyncio.gather(
            *(score_chunk(batch[i : i + size]) for i in range(0, len(batch), size))
        )

    # ------------------------------------------------------------------ hooks

    def check_group(self, group: list[Rollout]) -> None:
        """Refuse a group this algorithm cannot train on. Default: :func:`check_group`."""
        check_group(group, self.name)

    def build_samples(self, rollout: Rollout) -> list[TrainingSample]:
        """One rollout's training samples: the plain sample (:func:`rollout_to_sample`), with
        ``ce_weights`` on observation tokens where :meth:`observation_weights` gives any.

        Raises:
            ValueError: ``observation_weights`` is not one weight per completion token.
        """
        sample = rollout_to_sample(rollout, source=self.name)
        observed = self.observation_weights(rollout)
        if len(observed) != len(rollout.completion_ids):
            raise ValueError(
                f"{self.name}: observation_weights gave {len(observed)} weights for the "
                f"{len(rollout.completion_ids)} completion tokens of a rollout of task "
                f"{rollout.task_id!r}; return one weight per completion token"
            )
        if any(observed):
            sample.ce_weights = on_completion(rollout, observed)
        return [sample]

    def observation_weights(self, rollout: Rollout) -> list[float]:
        """Per completion token, the ce weight of observation tokens (default all 0.0)."""
        return [0.0] * len(rollout.completion_ids)

    def finalize_group(
        self, group: list[Rollout], samples: list[TrainingSample]
    ) -> list[TrainingSample]:
        """Group-level credit over the group's samples (``build_samples`` of each rollout,
        in group order); returns the group's samples. Default: ``samples`` unchanged."""
        return samples

    async def score_samples(self, samples: list[TrainingSample]) -> None:
        """Fill model-dependent streams (reference log-probs) of ``samples`` in place, with
        the connected frozen pools. Default: nothing."""

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue exactly (e.g. a pair pool's draw order)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. Default: nothing to restore."""


# ------------------------------------------------------------------ shared helpers


def check_group(group: Sequence[Rollout], algorithm: str) -> None:
    """A group is a non-empty list of rollouts of one task."""
    if not group:
        raise ValueError(f"{algorithm}: process_group() got an empty group")
    tasks = {r.task_id for r in group}
    if len(tasks) > 1:
        raise ValueError(
            f"{algorithm}: a group holds rollouts of one task, got task ids {sorted(tasks)}"
        )


def one_per_rollout(
    group: Sequence[Rollout], samples: Sequence[TrainingSample]
) -> list[tuple[Rollout, TrainingSample]]:
    """Each rollout with its sample, for a ``finalize_group`` that credits rollouts.

    Raises:
        ValueError: ``build_samples`` did not make exactly one sample per rollout.
    """
    if len(samples) != len(group):
        raise ValueError(
            f"finalize_group credits one sample per rollout, but build_samples made "
            f"{len(samples)} samples for {len(group)} rollouts"
        )
    return list(zip(group, samples))


def rollout_to_sample(rollout: Rollout, *, source: str) -> TrainingSample:
    """The plain sample of a rollout: prompt + completion, trainable on sampled tokens.

    ``loss_mask`` is 0 on the prompt and the completion mask on the completion;
    ``inference_logprobs`` is 0.0 on the prompt. No component stream is set. An agent
    episode cut short by a budget is marked (``metadata["truncated"]``) for the truncation
    filter.
    """
    n_prompt = len(rollout.prompt_ids)
    metadata: dict[str, Any] = {"reward": float(rollout.reward)}
    if rollout.truncated:
        metadata["truncated"] = True
    return TrainingSample(
        input_ids=rollout.input_ids,
        loss_mask=[0] * n_prompt + [int(m) for m in rollout.completion_mask or ()],
        inference_logprobs=[0.0] * n_prompt + [float(x) for x in rollout.inference_logprobs],
        task_id=rollout.task_id,
        source=source,
        metadata=metadata,
    )


def on_completion(rollout: Rollout, values: Sequence[float]) -> list[float]:
    """A per-completion-token stream padded with 0.0 over the prompt (sample length)."""
    return [0.0] * len(rollout.prompt_ids) + [float(v) for v in values]


def sampled(rollout: Rollout, value: float) -> list[float]:
    """``value`` on the rollout's sampled tokens, 0.0 elsewhere, over the whole sample."""
    return on_completion(rollout, [value if m else 0.0 for m in rollout.completion_mask or ()])


def credited(rollout: Rollout, advantage: float, turn_weight: float = 0.0) -> list[float]:
    """``advantage`` on the rollout's sampled tokens (over the whole sample), plus, for an
    agent episode, ``turn_weight`` times each turn's reward (``context.turn_rewards``) on
    that turn's sampled tokens."""
    values = sampled(rollout, advantage)
    if not turn_weight:
        return values
    from composer_replication.algo.context import turn_rewards

    start = len(rollout.prompt_ids)
    for step, reward in zip(rollout.trajectory, turn_rewards(rollout)):
        if reward:
            for j, m in enumerate(step.completion_mask):
                if m:
                    values[start + step.start + j] += turn_weight * reward
    return values


def zeros(sample: TrainingSample) -> list[float]:
    return [0.0] * sample.n_tokens


async def fill_ref_logprobs(samples: Sequence[TrainingSample], scorer: PrefillScorer) -> None:
    """Score each sample's pending reference context and set ``ref_logprobs``.

    The group stage leaves ``metadata[REF_CONTEXT]`` (the context token ids) and
    ``metadata[REF_INDEX]`` (per sample token, its position in that context or -1). Here
    the scorer computes the context's log-probs from its first mapped position on, and they
    are aligned back onto the sample; positions without ref_kl weight get 0.0. The request
    is removed from the metadata once filled, so scoring twice is free.
    """
    todo = [s for s in samples if REF_CONTEXT in s.metadata]
    if not todo:
        return
    starts = [_first_mapped(s) for s in todo]
    scored = await scorer.score([s.metadata[REF_CONTEXT] for s in todo], starts)
    for sample, start, values in zip(todo, starts, scored):
        aligned = align_prefill_logprobs(values, sample.metadata[REF_INDEX], start)
        weights = sample.ref_kl_weights or zeros(sample)
        sample.ref_logprobs = [v if w != 0 else 0.0 for v, w in zip(aligned, weights)]
        del sample.metadata[REF_CONTEXT], sample.metadata[REF_INDEX]


def _first_mapped(sample: TrainingSample) -> int:
    mapped = [i for i in sample.metadata[REF_INDEX] if i >= 0]
    if not mapped or min(mapped) < 1:
        raise ValueError(
            f"sample {sample.task_id}: the reference context maps no token at position >= 1 "
            "(the first token of a sequence has no log-prob)"
        )
    return min(mapped)
