"""Rollout statistics of several ranks merged as one process would report them."""

from __future__ import annotations

import pytest

from composer_replication.distributed.data_parallel import merge_rollout_stats


def test_merge_rollout_stats_by_hand():
    a = {
        "reward/mean": 0.5,
        "reward/solved": 0.25,
        "rollouts/count": 4.0,
        "rollouts/errors": 1.0,
        "hack/flagged": 1.0,
        "hack/flagged_fraction": 0.25,
        "time/generate_score_s": 3.0,
        "tokens/sampled": 100.0,
        "tokens_per_s/generate": 10.0,
    }
    b = {
        "reward/mean": 1.0,
        "reward/solved": 1.0,
        "rollouts/count": 2.0,
        "rollouts/errors": 0.0,
        "hack/flagged": 1.0,
        "hack/flagged_fraction": 0.5,
        "time/generate_score_s": 5.0,
        "tokens/sampled": 40.0,
        "tokens_per_s/generate": 8.0,
    }
    merged = merge_rollout_stats([a, b])
    # 6 rollouts: rewards 4 x mean 0.5 and 2 x 1.0 -> 4/6; solved 1 + 2 of 6
    assert merged["reward/mean"] == pytest.approx(4 / 6)
    assert merged["reward/solved"] == pytest.approx(3 / 6)
    assert merged["rollouts/count"] == 6.0 and merged["rollouts/errors"] == 1.0
    assert merged["hack/flagged"] == 2.0
    assert merged["hack/flagged_fraction"] == pytest.approx(2 / 6)
    assert merged["time/generate_score_s"] == 5.0  # the slowest rank
    assert merged["tokens/sampled"] == 140.0 and merged["tokens_per_s/generate"] == 18.0
    assert merge_rollout_stats([a]) == a
