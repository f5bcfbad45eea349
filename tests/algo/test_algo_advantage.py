"""Advantage math on hand-made groups, checked against hand values and trl's GRPO formula."""

from __future__ import annotations

import math

import pytest
import torch
from trl.trainer.utils import nanstd

from composer_replication.algo.advantage import (
    align_prefill_logprobs,
    broadcast_to_tokens,
    grpo_advantages,
    length_penalty,
    max_rl_advantages,
)


def test_dr_grpo_is_reward_minus_mean():
    assert grpo_advantages([1.0, 0.0, 0.0, 1.0]).tolist() == [0.5, -0.5, -0.5, 0.5]
    assert grpo_advantages([0.2, 0.4, 0.9]).tolist() == pytest.approx([-0.3, -0.1, 0.4])
    assert grpo_advantages(torch.tensor([3.0, 3.0])).tolist() == [0.0, 0.0]


def test_grpo_std_normalize_uses_sample_std():
    # sample std of [1, 0, 0, 1]: sqrt(4 * 0.25 / 3) = sqrt(1/3)
    std = math.sqrt(1 / 3)
    a = 0.5 / (std + 1e-6)
    got = grpo_advantages([1.0, 0.0, 0.0, 1.0], std_normalize=True)
    assert got.tolist() == pytest.approx([a, -a, -a, a], rel=1e-15)


def test_grpo_std_normalize_matches_trl_group_scaling():
    # trl GRPOTrainer, scale_rewards="group": (r - mean) / (nanstd(r) + 1e-4)
    rewards = torch.tensor([0.3, 1.0, 0.0, 0.7, 0.7], dtype=torch.float64)
    expected = (rewards - rewards.mean()) / (nanstd(rewards) + 1e-4)
    got = grpo_advantages(rewards, std_normalize=True, eps=1e-4)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-15)


def test_grpo_group_of_one_and_constant_group():
    assert grpo_advantages([0.7]).tolist() == [0.0]
    assert grpo_advantages([0.7], std_normalize=True).tolist() == [0.0]
    assert grpo_advantages([1.0, 1.0, 1.0], std_normalize=True).tolist() == [0.0, 0.0, 0.0]


def test_grpo_rejects_bad_rewards():
    with pytest.raises(ValueError, match="one group"):
        grpo_advantages([[1.0, 0.0]])
    with pytest.raises(ValueError, match="finite"):
        grpo_advantages([1.0, float("nan")])


def test_max_rl_divides_by_mean():
    got = max_rl_advantages([1.0, 0.0, 0.0, 0.0])
    assert (
        got.tolist() == [0.75 / (0.25 + 1e-6), -0.25 / (0.25 + 1e-6)] + [-0.25 / (0.25 + 1e-6)] * 2
    )
    assert max_rl_advantages([1.0, 1.0]).tolist() == [0.0, 0.0]
    assert max_rl_advantages([0.5, 1.0], eps=0.25).tolist() == [-0.25 / 1.0, 0.25 / 1.0]


def test_max_rl_zero_when_mean_not_positive():
    assert max_rl_advantages([0.0, 0.0, 0.0]).tolist() == [0.0, 0.0, 0.0]
    assert max_rl_advantages([-1.0, 0.0]).tolist() == [0.0, 0.0]
    assert max_rl_advantages([-1.0, 1.0]).tolist() == [0.0, 0.0]


def test_length_penalty_is_linear_beyond_the_target():
    got = length_penalty([50, 100, 150, 300], coefficient=0.2, target=100)
    assert got.tolist() == [0.0, 0.0, 0.2 * 0.5, 0.2 * 2.0]
    assert length_penalty([500], coefficient=0.0, target=None).tolist() == [0.0]
    with pytest.raises(ValueError, match="length_target"):
        length_penalty([5], coefficient=0.1, target=None)


def test_broadcast_to_tokens_puts_the_advantage_on_sampled_tokens():
    assert broadcast_to_tokens(0.5, [1, 1, 0, 0, 1]) == [0.5, 0.5, 0.0, 0.0, 0.5]
    assert broadcast_to_tokens(-1, []) == []


def test_align_prefill_logprobs_maps_context_positions_to_sample_positions():
    # sample: 3 prompt tokens + 2 completion tokens; the context has a 5-token prompt
    index = [-1, -1, -1, 5, 6]
    assert align_prefill_logprobs([-0.5, -0.25], index, start=5) == [0.0, 0.0, 0.0, -0.5, -0.25]
    # scored from an earlier start: entries before the mapped positions are skipped
    assert align_prefill_logprobs([-9.0, -0.5, -0.25], index, start=4) == [
        0.0,
        0.0,
        0.0,
        -0.5,
        -0.25,
    ]
    with pytest.raises(ValueError, match="only 1 log-probs"):
        align_prefill_logprobs([-0.5], index, start=5)
