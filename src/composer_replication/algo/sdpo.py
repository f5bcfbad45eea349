"""``sdpo``: Dr.GRPO plus self-distillation to the hinted policy at error sites.

SDPO (arXiv 2601.20802), Composer channel 2. Every rollout gets the group-relative
Dr.GRPO advantage on its sampled tokens (``rl``). A rollout at an error site (it has
``feedback`` / ``error``, or a reward below the group's best) also gets a teacher context:
its prompt re-rendered with a note in the last user message, followed by the same
completion ids. The note is a better sibling's completion as a demonstration (when
``use_sibling_demos`` and one exists), else, with ``use_reference_demos``, the task's
reference solution (``rollout.reference``, from environments that have one: the
teacher then knows an answer the student does not, privileged-information
self-distillation), else a hint (``hint_source``: ``hint_generator`` on
the feedback, the raw feedback, or none). The trainer's ``jsd`` component (weight
``alpha_sdpo`` on the sampled tokens) matches the plain-context policy to the teacher model
(live policy, frozen initial policy or EMA, per ``teacher``) on that context.
"""

from __future__ import annotations

from typing import Any

from composer_replication.algo.advantage import grpo_advantages
from composer_replication.algo.base import (
    Algorithm,
    AlgorithmResources,
    one_per_rollout,
    sampled,
)
from composer_replication.algo.context import (
    better_sibling,
    demonstration_text,
    hint_text,
    is_error_site,
    teacher_context,
)
from composer_replication.config.advantage import DEFAULT_DEMO_TEMPLATE, DEFAULT_HINT_TEMPLATE
from composer_replication.rollout.types import Rollout
from composer_replication.wire import TrainingSample


def attach_self_distillation(
    sample: TrainingSample,
    group: list[Rollout],
    i: int,
    *,
    tokenizer: Any,
    alpha: float,
    use_sibling_demos: bool,
    hint_source: str,
    use_reference_demos: bool = False,
) -> None:
    """Give ``sample`` (of ``group[i]``) a teacher context and jsd weights if it is an error
    site with a note; ``metadata["jsd_note"]`` records "demo", "reference" or "hint"."""
    rollout = group[i]
    if alpha == 0 or not rollout.n_sampled_tokens or not is_error_site(group, i):
        return
    sibling = better_sibling(group, i) if use_sibling_demos else None
    reference = rollout.reference if use_reference_demos else None
    if sibling is not None or reference:
        demo = demonstration_text(tokenizer, sibling) if sibling is not None else str(reference)
        ids, index = teacher_context(tokenizer, rollout, DEFAULT_DEMO_TEMPLATE, demonstration=demo)
        note = "demo" if sibling is not None else "reference"
    else:
        hint = hint_text(rollout, hint_source)
        if hint is None:
            return
        ids, index = teacher_context(tokenizer, rollout, DEFAULT_HINT_TEMPLATE, hint=hint)
        note = "hint"
    sample.teacher_input_ids, sample.teacher_index = ids, index
    sample.jsd_weights = sampled(rollout, alpha)
    sample.metadata["jsd_note"] = note


class SDPOAlgorithm(Algorithm):
    """rl (Dr.GRPO) on every rollout + jsd to the hinted policy at error sites."""

    name = "sdpo"
    components = ("rl", "jsd")

    def __init__(self, config: Any, tokenizer: Any) -> None:
        super().__init__(config)
        self.tokenizer = tokenizer

    @classmethod
    def from_resources(cls, config: Any, resources: AlgorithmResources) -> SDPOAlgorithm:
        if resources.tokenizer is None:
            raise ValueError(f"{cls.name} needs tokenizer= to render hinted teacher contexts")
        return cls(config, resources.tokenizer)

    def finalize_group(
        self, group: list[Rollout], samples: list[TrainingSample]
    ) -> list[TrainingSample]:
        grpo_with_self_distillation(group, samples, self.advantage_config, self.tokenizer)
        return samples


def grpo_with_self_distillation(
    group: list[Rollout], samples: list[TrainingSample], cfg: Any, tokenizer: Any
) -> None:
    """Dr.GRPO advantages on each rollout's sample + the jsd stream at error sites, in place
    (the group stage of sdpo and composer)."""
    advantages = grpo_advantages([r.reward for r in group]).tolist()
    for i, ((rollout, sample), advantage) in enumerate(
        zip(one_per_rollout(group, samples), advantages)
    ):
        sample.advantages = sampled(rollout, advantage)
        attach_self_distillation(
            sample,
            group,
            i,
            tokenizer=tokenizer,
            alpha=cfg.alpha_sdpo,
            use_sibling_demos=cfg.use_sibling_demos,
            hint_source=cfg.hint_source,
            use_reference_demos=cfg.use_reference_demos,
        )
