"""The truncation filter (``[filters.truncated]``) on a real algorithm's samples.

A group of four agent episodes, two of them cut short by a budget (the turn limit, the
reply budget), goes through ``TruncationFilter.penalize``, the real algorithm's
``process_group`` and the filter, as the training loop runs them: ``keep`` trains them as
they scored, ``mask`` takes their rl part out of the batch while their rewards still set the
group's baseline, ``penalize`` lowers their rewards before the advantages are computed.
"""

from __future__ import annotations

import pydantic
import pytest

from composer_replication.algo import AlgorithmConfig, build_algorithm
from composer_replication.algo.advantage import grpo_advantages
from composer_replication.algo.base import rollout_to_sample
from composer_replication.algo.filters import TruncationFilter
from composer_replication.config import RunConfig
from composer_replication.config.filters import FiltersConfig, TruncatedFilterConfig
from composer_replication.samples.rollouts import TRUNCATED_END_REASONS, Rollout

MESSAGES = [{"role": "user", "content": "Restore median(values)."}]
TEXTS = [
    '<tool_call>{"name": "finish", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "read_file", "arguments": {"path": "a.py"}}</tool_call>',
    "I will look at the file first and then",
    "The function is restored.",
]
REWARDS = [1.0, 0.0, 0.0, 0.5]
END_REASONS = ["finish", "turn_limit", "truncated", "answer"]
TRUNCATED = [False, True, True, False]


def _group(tokenizer, rewards=REWARDS, end_reasons=END_REASONS, feedback=None) -> list[Rollout]:
    prompt = list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"])
    group = []
    for text, reward, reason in zip(TEXTS, rewards, end_reasons):
        completion = [*tokenizer(text, add_special_tokens=False)["input_ids"]]
        metadata = {} if reason is None else {"end_reason": reason, "turns": 1}
        group.append(
            Rollout(
                task_id="fd:median",
                prompt_ids=prompt,
                completion_ids=completion,
                inference_logprobs=[-0.25] * len(completion),
                reward=reward,
                prompt_messages=MESSAGES,
                feedback=feedback if reason in TRUNCATED_END_REASONS else None,
                metadata=metadata,
            )
        )
    return group


def _algorithm(tokenizer, advantage: str = "grpo"):
    return build_algorithm(AlgorithmConfig(advantage={"type": advantage}), tokenizer=tokenizer)


def _expected_advantages(rollout: Rollout, advantage: float) -> list[float]:
    return [0.0] * len(rollout.prompt_ids) + [advantage] * len(rollout.completion_ids)


def _step(filt: TruncationFilter, algorithm, group: list[Rollout]):
    """What the loop does with one group: penalize, process_group, the filter."""
    filt.penalize(group)
    samples = algorithm.process_group(group)
    return samples, filt(samples)


# ------------------------------------------------------------------ the rollout's side


def test_truncated_rollouts_are_the_budget_end_reasons(tokenizer):
    assert {"truncated", "turn_limit", "token_limit"} == TRUNCATED_END_REASONS
    reasons = [
        "truncated",
        "turn_limit",
        "token_limit",
        "answer",
        "finish",
        "sandbox_error",
        "render_error",
        None,
    ]
    # four texts per _group: two groups give the eight end reasons
    group = _group(tokenizer, [0.0] * 4, reasons[:4]) + _group(tokenizer, [0.0] * 4, reasons[4:])
    assert [r.metadata.get("end_reason") for r in group] == reasons
    assert [r.truncated for r in group] == [True, True, True, False, False, False, False, False]
    samples = [rollout_to_sample(r, source="grpo") for r in group]
    assert [s.metadata for s in samples] == [
        {"reward": 0.0, "truncated": True},
        {"reward": 0.0, "truncated": True},
        {"reward": 0.0, "truncated": True},
        {"reward": 0.0},
        {"reward": 0.0},
        {"reward": 0.0},
        {"reward": 0.0},
        {"reward": 0.0},
    ]


# ------------------------------------------------------------------ keep


def test_keep_trains_cut_short_episodes_as_they_scored(tokenizer):
    group = _group(tokenizer)
    filt = TruncationFilter()
    assert filt.mode == "keep" and filt.penalty == 0.5
    samples, kept = _step(filt, _algorithm(tokenizer), group)
    assert [id(s) for s in kept] == [id(s) for s in samples]
    assert [r.reward for r in group] == REWARDS
    assert [bool(s.metadata.get("truncated")) for s in kept] == TRUNCATED
    advantages = grpo_advantages(REWARDS).tolist()
    assert advantages == [0.625, -0.375, -0.375, 0.125]
    for rollout, sample, advantage in zip(group, kept, advantages):
        assert sample.advantages == _expected_advantages(rollout, advantage)
        assert sample.rl_weights is None
        assert "reward_before_truncation" not in rollout.metadata
    assert filt.metrics() == {"rollouts/truncated": 2.0, "rollouts/truncated_masked": 0.0}


# ------------------------------------------------------------------ mask


def test_mask_drops_the_cut_short_samples_but_keeps_them_in_the_baseline(tokenizer):
    group = _group(tokenizer)
    filt = TruncationFilter(mode="mask")
    samples, kept = _step(filt, _algorithm(tokenizer), group)
    assert len(samples) == 4
    assert [s.metadata["reward"] for s in kept] == [1.0, 0.5]
    assert [id(s) for s in kept] == [id(samples[0]), id(samples[3])]
    # the advantages are those of all four rewards, not of the two that stay
    full = grpo_advantages(REWARDS).tolist()
    assert kept[0].advantages == _expected_advantages(group[0], full[0])
    assert kept[1].advantages == _expected_advantages(group[3], full[3])
    assert full[3] == 0.125 and grpo_advantages([1.0, 0.5]).tolist()[1] == -0.25
    assert [r.reward for r in group] == REWARDS  # mask never changes a reward
    assert filt.metrics() == {"rollouts/truncated": 2.0, "rollouts/truncated_masked": 2.0}


def test_mask_keeps_a_cut_short_samples_other_signal_without_rl(tokenizer):
    # sdpo: the cut-short episodes are error sites with feedback, so they also train jsd
    group = _group(tokenizer, feedback="Error: the turn limit (1) was reached")
    filt = TruncationFilter(mode="mask")
    samples, kept = _step(filt, _algorithm(tokenizer, "sdpo"), group)
    assert [s.jsd_weights is not None for s in samples] == [False, True, True, True]
    assert len(kept) == 4
    for original, out, truncated in zip(samples, kept, TRUNCATED):
        if truncated:
            assert out is not original
            assert out.rl_weights == [0.0] * original.n_tokens and out.n_live_rl_tokens == 0
            assert out.jsd_weights == original.jsd_weights
            assert out.teacher_input_ids == original.teacher_input_ids
            assert out.advantages == original.advantages
            assert original.rl_weights is None  # the algorithm's sample is not modified
        else:
            assert out is original and out.rl_weights is None
    full = grpo_advantages(REWARDS).tolist()
    assert kept[3].advantages == _expected_advantages(group[3], full[3])
    assert filt.metrics() == {"rollouts/truncated": 2.0, "rollouts/truncated_masked": 2.0}


def test_mask_leaves_samples_without_rl_credit_alone(tokenizer):
    # sft on reference solutions has no advantages: nothing of rl to take out
    sft = build_algorithm(
        AlgorithmConfig.model_validate(
            {"sampling": {"source": "reference"}, "advantage": {"type": "sft"}}
        ),
        tokenizer=tokenizer,
    )
    group = _group(tokenizer)
    filt = TruncationFilter(mode="mask")
    samples = sft.process_group(group[1:2])
    assert samples[0].advantages is None and samples[0].metadata["truncated"] is True
    assert filt(samples) == samples
    assert filt.metrics()["rollouts/truncated_masked"] == 0.0


# ------------------------------------------------------------------ penalize


def test_penalize_lowers_the_cut_short_rewards_before_the_advantages(tokenizer):
    rewards = [1.0, 0.0, 0.5, 0.5]
    group = _group(tokenizer, rewards=rewards)
    filt = TruncationFilter(mode="penalize", penalty=0.25)
    samples, kept = _step(filt, _algorithm(tokenizer), group)
    assert [id(s) for s in kept] == [id(s) for s in samples]
    assert [r.reward for r in group] == [1.0, -0.25, 0.25, 0.5]
    assert [r.metadata.get("reward_before_truncation") for r in group] == [None, 0.0, 0.5, None]
    assert [s.metadata["reward"] for s in kept] == [1.0, -0.25, 0.25, 0.5]
    # mean 0.375: the advantages of the lowered rewards
    advantages = grpo_advantages([1.0, -0.25, 0.25, 0.5]).tolist()
    assert advantages == [0.625, -0.625, -0.125, 0.125]
    for rollout, sample, advantage in zip(group, kept, advantages):
        assert sample.advantages == _expected_advantages(rollout, advantage)
    assert filt.metrics() == {"rollouts/truncated": 2.0, "rollouts/truncated_masked": 0.0}


def test_penalize_uses_the_default_penalty_and_counts_across_groups(tokenizer):
    filt = TruncationFilter(mode="penalize")
    algorithm = _algorithm(tokenizer)
    first, second = _group(tokenizer), _group(tokenizer, end_reasons=["token_limit"] * 4)
    _step(filt, algorithm, first)
    _step(filt, algorithm, second)
    assert [r.reward for r in first] == [1.0, -0.5, -0.5, 0.5]
    assert [r.reward for r in second] == [0.5, -0.5, -0.5, 0.0]
    assert filt.metrics() == {"rollouts/truncated": 6.0, "rollouts/truncated_masked": 0.0}


# ------------------------------------------------------------------ config


def test_the_config_defaults_to_keep_and_validates():
    assert RunConfig.default().filters.truncated == TruncatedFilterConfig(mode="keep", penalty=0.5)
    cfg = RunConfig.from_toml("[filters.truncated]\nmode = 'penalize'\npenalty = 0.2\n")
    assert (cfg.filters.truncated.mode, cfg.filters.truncated.penalty) == ("penalize", 0.2)
    assert RunConfig.default(["filters.truncated.mode=mask"]).filters.truncated.mode == "mask"
    assert FiltersConfig.model_validate({"truncated": {"penalty": 0}}).truncated.penalty == 0.0
    with pytest.raises(pydantic.ValidationError, match="'keep', 'mask' or 'penalize'"):
        FiltersConfig.model_validate({"truncated": {"mode": "drop"}})
    with pytest.raises(pydantic.ValidationError, match="greater than or equal to 0"):
        FiltersConfig.model_validate({"truncated": {"mode": "penalize", "penalty": -0.5}})
    with pytest.raises(pydantic.ValidationError, match="Extra inputs are not permitted"):
        TruncatedFilterConfig.model_validate({"mode": "mask", "enforce": True})
    with pytest.raises(pydantic.ValidationError, match="finite number"):
        TruncatedFilterConfig.model_validate({"penalty": float("inf")})
    with pytest.raises(ValueError, match="truncated filter mode 'drop': use keep, mask or"):
        TruncationFilter(mode="drop")


# ------------------------------------------------------------------ several ranks


def test_two_ranks_counts_add_up_as_one_process_reports_them(tokenizer):
    from composer_replication.distributed.data_parallel import merge_rollout_stats

    algorithm = _algorithm(tokenizer)
    one_process = TruncationFilter(mode="mask")
    ranks = [TruncationFilter(mode="mask"), TruncationFilter(mode="mask")]
    for filt, end_reasons in zip(ranks, (END_REASONS, ["token_limit"] * 4)):
        _step(filt, algorithm, _group(tokenizer, end_reasons=end_reasons))
        _step(one_process, algorithm, _group(tokenizer, end_reasons=end_reasons))
    assert one_process.metrics() == {
        "rollouts/truncated": 6.0,
        "rollouts/truncated_masked": 6.0,
    }
    assert merge_rollout_stats([f.metrics() for f in ranks]) == one_process.metrics()
