"""The ``Algorithm`` interface and the shared Rollout -> TrainingSample conversion.

An algorithm turns a finished group of rollouts into training samples: per-token weight
streams on the trainer's fixed loss components (``rl``, ``ce``, ``ref_kl``, ``jsd``,
``dpo``). It has three hooks:

- ``assign(group)``: synchronous, at group finalisation; fills advantages and weights.
- ``async score(samples)``: at ship time; fills reference log-probs that need a model
  (a frozen teacher's prefill log-probs, DPO reference log-probs). Default: no-op.
- ``observation_weights(rollout)``: per completion token, the ``ce`` weight of
  environment-provided tokens; default 0.0 everywhere (observations are masked).

An algorithm owns its resources: its ``build`` step takes what it needs from
:class:`AlgorithmResources` (tokenizer, pairs, scorers, the live policy for an in-process
reference). The loss settings and the jsd teacher it requires are declared by its config
(``AdvantageConfig.loss_requirements`` / ``teacher_mode``) and resolved when the run config
is validated: the trainer never branches on an algorithm's name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from composer_replication.algo.advantage import align_prefill_logprobs
from composer_replication.rollout.types import Rollout
from composer_replication.wire import TrainingSample

if TYPE_CHECKING:
    import random

    from composer_replication.algo.scoring import PrefillScorer
    from composer_replication.config.algorithm import AlgorithmConfig

# Sample metadata keys of a pending reference-log-prob request (set by assign, used by score).
REF_CONTEXT = "ref_context_ids"
REF_INDEX = "ref_context_index"


@dataclass
class AlgorithmResources:
    """What ``build_algorithm`` hands an algorithm class; each takes what it needs.

    Attributes:
        tokenizer: the policy's tokenizer.
        scorer: prefill scorer of an opd teacher / opsd reference (built from the config's
            frozen model when None; over ``policy`` for a ``"policy"`` reference).
        reference_scorer: frozen reference for DPO log-probs (None: the trainer's).
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


class Algorithm(ABC):
    """One algorithm: group of rollouts in, training samples out."""

    name: ClassVar[str]
    components: ClassVar[tuple[str, ...]]

    def __init__(self, config: AlgorithmConfig) -> None:
        if config.advantage.type != self.name:
            raise ValueError(
                f"{type(self).__name__} needs advantage.type = {self.name!r}, got "
                f"{config.advantage.type!r}; use build_algorithm(config)"
            )
        self.config = config

    @classmethod
    def build(cls, config: AlgorithmConfig, resources: AlgorithmResources) -> Algorithm:
        """Construct from a config and the run's resources (override to take some)."""
        return cls(config)

    @property
    def advantage_config(self) -> Any:
        """``config.advantage``, the algorithm's own settings."""
        return self.config.advantage

    @abstractmethod
    def assign(self, group: list[Rollout]) -> list[TrainingSample]:
        """Training samples of one finished group (advantage streams and weights)."""

    async def score(self, samples: list[TrainingSample]) -> None:  # noqa: B027
        """Fill model-dependent streams (reference log-probs) in place. Default: nothing."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue exactly (e.g. a pair pool's draw order)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027
        """Restore :meth:`state_dict`. Default: nothing to restore."""

    def observation_weights(self, rollout: Rollout) -> list[float]:
        """Per completion token, the ce weight of observation tokens (default all 0.0)."""
        return [0.0] * len(rollout.completion_ids)


# ------------------------------------------------------------------ shared helpers


def check_group(group: Sequence[Rollout], algorithm: str) -> None:
    """A group is a non-empty list of rollouts of one task."""
    if not group:
        raise ValueError(f"{algorithm}: assign() got an empty group")
    tasks = {r.task_id for r in group}
    if len(tasks) > 1:
        raise ValueError(
            f"{algorithm}: a group holds rollouts of one task, got task ids {sorted(tasks)}"
        )


def rollout_to_sample(rollout: Rollout, *, source: str) -> TrainingSample:
    """The plain sample of a rollout: prompt + completion, trainable on sampled tokens.

    ``loss_mask`` is 0 on the prompt and the completion mask on the completion;
    ``inference_logprobs`` is 0.0 on the prompt. No component stream is set.
    """
    n_prompt = len(rollout.prompt_ids)
    return TrainingSample(
        input_ids=rollout.input_ids,
        loss_mask=[0] * n_prompt + [int(m) for m in rollout.completion_mask or ()],
        inference_logprobs=[0.0] * n_prompt + [float(x) for x in rollout.inference_logprobs],
        task_id=rollout.task_id,
        source=source,
        metadata={"reward": float(rollout.reward)},
    )


def on_completion(rollout: Rollout, values: Sequence[float]) -> list[float]:
    """A per-completion-token stream padded with 0.0 over the prompt (sample length)."""
    return [0.0] * len(rollout.prompt_ids) + [float(v) for v in values]


def sampled(rollout: Rollout, value: float) -> list[float]:
    """``value`` on the rollout's sampled tokens, 0.0 elsewhere, over the whole sample."""
    return on_completion(rollout, [value if m else 0.0 for m in rollout.completion_mask or ()])


def zeros(sample: TrainingSample) -> list[float]:
    return [0.0] * sample.n_tokens


async def fill_ref_logprobs(samples: Sequence[TrainingSample], scorer: PrefillScorer) -> None:
    """Score each sample's pending reference context and set ``ref_logprobs``.

    ``assign`` leaves ``metadata[REF_CONTEXT]`` (the context token ids) and
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
