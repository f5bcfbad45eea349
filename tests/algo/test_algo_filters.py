"""The zero-advantage filter on real algorithms' samples: zero-advantage groups lose their
rl part, never another component's signal; groups that learn and samples without rl
credit pass untouched."""

from __future__ import annotations

import pytest

from composer_replication.algo import AlgorithmConfig, build_algorithm
from composer_replication.algo.filters import (
    ZeroAdvantageFilter,
    carries_other_signal,
    is_zero_advantage_group,
)
from composer_replication.config import RunConfig
from composer_replication.samples.rollouts import Rollout
from composer_replication.samples.wire import DPOPairTokens, TrainingSample, pack_samples

MESSAGES = [{"role": "user", "content": "Write add(a, b)."}]
CRASH = 'Traceback (most recent call last):\n  File "t.py", line 2\nZeroDivisionError: x'
PAIRS = [{"state_messages": MESSAGES, "chosen": "return a + b", "rejected": "return a - b"}]


def _rollout(tokenizer, text: str, reward: float, feedback: str | None = None) -> Rollout:
    prompt = list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"])
    completion = [*tokenizer(text, add_special_tokens=False)["input_ids"], 2]
    return Rollout(
        task_id="add",
        prompt_ids=prompt,
        completion_ids=completion,
        inference_logprobs=[-0.5] * len(completion),
        reward=reward,
        prompt_messages=MESSAGES,
        feedback=feedback,
    )


def _assign(tokenizer, advantage: dict, rewards, feedback=None, **resources):
    algo = build_algorithm(AlgorithmConfig(advantage=advantage), tokenizer=tokenizer, **resources)
    texts = ["def add(a, b):\n    return a + b", "def add(a, b):\n    return a - b", "pass"]
    group = [
        _rollout(tokenizer, texts[i % 3], r, feedback=(feedback if i == 0 else None))
        for i, r in enumerate(rewards)
    ]
    return algo.process_group(group)


def _counts(samples) -> dict[str, int]:
    totals: dict[str, int] = {}
    for batch in pack_samples(samples, max_tokens=100_000, split=None):
        for name, n in batch.counts.items():
            totals[name] = totals.get(name, 0) + n
    return totals


def test_a_uniform_grpo_group_is_dropped_and_counted(tokenizer):
    samples = _assign(tokenizer, {"type": "grpo"}, [0.5, 0.5, 0.5])
    assert is_zero_advantage_group(samples)
    kept = (zero_filter := ZeroAdvantageFilter())(samples)
    assert kept == []
    assert zero_filter.metrics() == {
        "rollouts/zero_advantage": 3.0,
        "rollouts/zero_advantage_dropped": 3.0,
    }


def test_a_group_that_learns_passes_untouched(tokenizer):
    samples = _assign(tokenizer, {"type": "grpo"}, [1.0, 0.0, 0.5])
    zero_filter = ZeroAdvantageFilter()
    kept = zero_filter(samples)
    assert [id(s) for s in kept] == [id(s) for s in samples]
    assert all(s.rl_weights is None for s in kept)
    assert zero_filter.metrics()["rollouts/zero_advantage"] == 0.0


def test_self_distillation_keeps_its_jsd_and_loses_only_rl(tokenizer):
    # all failed: no advantage, but the error site's hinted context is jsd signal
    samples = _assign(tokenizer, {"type": "sdpo"}, [0.0, 0.0, 0.0], feedback=CRASH)
    before = _counts(samples)
    assert before["jsd"] > 0 and before["rl"] > 0
    zero_filter = ZeroAdvantageFilter()
    kept = zero_filter(samples)
    assert len(kept) == 1 and carries_other_signal(kept[0])
    after = _counts(kept)
    assert after["rl"] == 0 and after["jsd"] == before["jsd"]
    (original,) = [s for s in samples if s.jsd_weights is not None]
    assert kept[0].jsd_weights == original.jsd_weights
    assert kept[0].teacher_input_ids == original.teacher_input_ids
    assert kept[0].rl_weights == [0.0] * original.n_tokens
    assert original.rl_weights is None  # the algorithm's sample is not modified
    assert zero_filter.metrics() == {
        "rollouts/zero_advantage": 3.0,
        "rollouts/zero_advantage_dropped": 2.0,
    }


def test_composer_pairs_survive_a_zero_advantage_group(tokenizer):
    samples = _assign(
        tokenizer, {"type": "composer", "pairs_per_group": 1}, [1.0, 1.0], pairs=PAIRS
    )
    before = _counts(samples)
    assert before["dpo"] == 1 and before["rl"] > 0
    kept = ZeroAdvantageFilter()(samples)
    after = _counts(kept)
    assert after["dpo"] == 1 and after["rl"] == 0
    assert [s.dpo is not None for s in kept] == [True]


def _sample(advantage: float | None, **streams) -> TrainingSample:
    n = 6
    return TrainingSample(
        input_ids=list(range(1, n + 1)),
        loss_mask=[0, 0, 1, 1, 1, 1],
        inference_logprobs=[0.0, 0.0, -0.1, -0.2, -0.3, -0.4],
        advantages=None if advantage is None else [0.0, 0.0] + [advantage] * 4,
        task_id="t",
        **streams,
    )


@pytest.mark.parametrize(
    "streams",
    [
        {"ce_weights": [0.0, 0.0, 0.0, 0.1, 0.1, 0.0]},  # echo: observation tokens
        {"ref_kl_weights": [0.0, 0.0, 1, 1, 1, 1], "ref_logprobs": [0.0, 0.0, -1, -1, -1, -1]},
    ],
)
def test_other_components_keep_their_sample(streams):
    group = [_sample(0.0, **streams), _sample(0.0)]
    before = _counts(group)
    kept = ZeroAdvantageFilter()(group)
    assert len(kept) == 1
    after = _counts(kept)
    other = "ce" if "ce_weights" in streams else "ref_kl"
    assert after[other] == before[other] > 0 and after["rl"] == 0


def test_samples_without_rl_credit_are_never_filtered():
    # opd / opsd / sft: advantages None and rl weights 0 (a uniform reward says nothing)
    distill = _sample(
        None,
        rl_weights=[0.0] * 6,
        ref_kl_weights=[0.0, 0.0, 1, 1, 1, 1],
        ref_logprobs=[0.0, 0.0, -1, -1, -1, -1],
    )
    pair = TrainingSample(
        input_ids=[],
        loss_mask=[],
        inference_logprobs=[],
        dpo=DPOPairTokens([1, 2, 3], [0, 1, 1], [1, 2, 4], [0, 1, 1]),
    )
    for group in ([distill, distill], [pair]):
        assert not is_zero_advantage_group(group)
        assert ZeroAdvantageFilter()(group) == group
    # rl tokens whose rl weight is 0 do not count: the live tokens' advantages decide
    masked = _sample(0.0, rl_weights=[0.0] * 6)
    assert not is_zero_advantage_group([masked])


def test_a_nonzero_advantage_on_one_token_is_signal():
    sample = _sample(0.0)
    sample.advantages[-1] = 0.25
    assert not is_zero_advantage_group([sample, _sample(0.0)])


def test_enforce_off_counts_and_keeps_everything(tokenizer):
    samples = _assign(tokenizer, {"type": "grpo"}, [0.0, 0.0])
    zero_filter = ZeroAdvantageFilter(enforce=False)
    assert zero_filter(samples) == samples
    assert zero_filter.metrics() == {
        "rollouts/zero_advantage": 2.0,
        "rollouts/zero_advantage_dropped": 0.0,
    }


def test_the_filter_is_on_by_default_and_a_setting_turns_it_off():
    assert RunConfig.default().filters.zero_advantage.enforce is True
    off = RunConfig.from_toml("[filters.zero_advantage]\nenforce = false\n")
    assert off.filters.zero_advantage.enforce is False
    assert RunConfig.default(["filters.zero_advantage.enforce=false"]) == off
