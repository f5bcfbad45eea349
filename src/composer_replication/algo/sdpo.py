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

In a multi-turn episode a hint is about the turn where the error happened
(``algo.context.turn_sites``: a malformed call, a failing tool call, the edit before a
failing test run): the teacher context is the conversation up to that turn with the hint
written into its last observation, followed by the same sampled tokens of that turn, and
only that turn's tokens take the jsd weight, one extra sample per site (no rl on it). An
episode that failed with no such turn gets its final feedback as the hint of its last edit.
"""

from __future__ import annotations

from typing import Any

from composer_replication.algo.advantage import grpo_advantages
from composer_replication.algo.base import (
    Algorithm,
    AlgorithmResources,
    credited,
    one_per_rollout,
    rollout_to_sample,
    sampled,
)
from composer_replication.algo.context import (
    TurnSite,
    better_sibling,
    demonstration_text,
    hint_for,
    hint_text,
    is_error_site,
    last_edit_step,
    teacher_context,
    turn_sites,
    turn_teacher_context,
)
from composer_replication.config.advantage import (
    DEFAULT_DEMO_TEMPLATE,
    DEFAULT_HINT_TEMPLATE,
    SDPOAdvantage,
)
from composer_replication.samples.rollouts import Rollout
from composer_replication.samples.wire import TrainingSample


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
) -> list[TrainingSample]:
    """Give ``sample`` (of ``group[i]``) a teacher context and jsd weights if it is an error
    site with a note; ``metadata["jsd_note"]`` records "demo", "reference" or "hint". A
    multi-turn episode's hints go to the turns they are about instead: returns one
    jsd-only sample per such turn (see the module docstring; none otherwise)."""
    rollout = group[i]
    if alpha == 0 or not rollout.n_sampled_tokens:
        return []
    failed = is_error_site(group, i)
    turns = []
    if _is_episode(rollout):  # hints go to the turns they are about
        turns = turn_samples(
            rollout, tokenizer=tokenizer, alpha=alpha, hint_source=hint_source, failed=failed
        )
    if not failed:
        return turns
    sibling = better_sibling(group, i) if use_sibling_demos else None
    reference = rollout.reference if use_reference_demos else None
    if sibling is not None or reference:
        demo = demonstration_text(tokenizer, sibling) if sibling is not None else str(reference)
        ids, index = teacher_context(tokenizer, rollout, DEFAULT_DEMO_TEMPLATE, demonstration=demo)
        note = "demo" if sibling is not None else "reference"
    else:
        hint = None if _is_episode(rollout) else hint_text(rollout, hint_source)
        if hint is None:
            return turns
        ids, index = teacher_context(tokenizer, rollout, DEFAULT_HINT_TEMPLATE, hint=hint)
        note = "hint"
    sample.teacher_input_ids, sample.teacher_index = ids, index
    sample.jsd_weights = sampled(rollout, alpha)
    sample.metadata["jsd_note"] = note
    return turns


def _is_episode(rollout: Rollout) -> bool:
    """An agent episode (it records its turns' events and conversation)."""
    return bool(rollout.metadata.get("events") is not None and rollout.metadata.get("conversation"))


def turn_samples(
    rollout: Rollout, *, tokenizer: Any, alpha: float, hint_source: str, failed: bool
) -> list[TrainingSample]:
    """One jsd-only sample per turn of ``rollout`` a hint is about (``turn_sites``; when it
    ``failed`` with none, its last edit with its final feedback): the rollout cut after that
    turn's sampled tokens, trainable and jsd-weighted (``alpha``) on those tokens only, with
    the hinted teacher context of that turn. ``metadata["jsd_note"]`` is "turn_hint" and
    ``metadata["jsd_turn"]`` the turn (1-based)."""
    sites = turn_sites(rollout)
    if not sites and failed and (rollout.feedback or rollout.error):
        sites = [TurnSite(last_edit_step(rollout), rollout.feedback or rollout.error or "")]
    out = []
    for site in sites:
        hint = hint_for(site.error, hint_source)
        if hint is None:
            continue
        try:
            ids, index, length = turn_teacher_context(
                tokenizer, rollout, site.step, DEFAULT_HINT_TEMPLATE, hint=hint
            )
        except ValueError:  # a turn without sampled tokens has nothing to distil
            continue
        turn = [1 if index[p] >= 0 else 0 for p in range(length)]
        base = rollout_to_sample(rollout, source="sdpo_turn")
        out.append(
            TrainingSample(
                input_ids=base.input_ids[:length],
                loss_mask=turn,
                inference_logprobs=base.inference_logprobs[:length],
                rl_weights=[0.0] * length,  # no rl credit on a site sample
                jsd_weights=[alpha * m for m in turn],
                teacher_input_ids=ids,
                teacher_index=index,
                task_id=rollout.task_id,
                source=base.source,
                metadata={"jsd_note": "turn_hint", "jsd_turn": site.step + 1},
            )
        )
    return out


class SDPOAlgorithm(Algorithm):
    """rl (Dr.GRPO) on every rollout + jsd to the hinted policy at error sites."""

    config_class = SDPOAdvantage

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
    (the group stage of sdpo and composer); a multi-turn episode's turn sites are appended
    to ``samples`` as samples of their own."""
    advantages = grpo_advantages([r.reward for r in group]).tolist()
    turns = []
    for i, ((rollout, sample), advantage) in enumerate(
        zip(one_per_rollout(group, samples), advantages)
    ):
        sample.advantages = credited(rollout, advantage, cfg.turn_reward_weight)
        turns += attach_self_distillation(
            sample,
            group,
            i,
            tokenizer=tokenizer,
            alpha=cfg.alpha_sdpo,
            use_sibling_demos=cfg.use_sibling_demos,
            hint_source=cfg.hint_source,
            use_reference_demos=cfg.use_reference_demos,
        )
    samples += turns
