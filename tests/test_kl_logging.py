"""integrations.altered_minds.kl_logging.token_mean_kl: the nats/token convention of the kill
switch, its two call forms, one host read, and the training loop's kl_to_init going through it."""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch

from composer_replication.integrations.altered_minds.kl_logging import (
    token_kl_sum,
    token_mean_kl,
)
from composer_replication.safety import HeldOutGuard
from composer_replication.testing.host_reads import HostReads


def test_token_mean_is_the_mean_over_counted_tokens_not_over_sequences():
    per_token = torch.tensor([[0.02, 0.04, 9.0], [0.06, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # three counted tokens: (0.02 + 0.04 + 0.06) / 3 = 0.04 nats/token
    assert token_mean_kl(per_token, mask) == pytest.approx(0.04, rel=1e-6)
    assert token_mean_kl(per_token[:, :1]) == pytest.approx(0.04, rel=1e-6)  # no mask: all
    # the summed form: a sum over n tokens (added up over batches or ranks)
    assert token_mean_kl(0.12, 3) == pytest.approx(0.04, rel=1e-12)
    assert token_mean_kl(torch.tensor(0.12, dtype=torch.float64), torch.tensor(3)) == (
        pytest.approx(0.04, rel=1e-6)
    )
    assert token_mean_kl(0.0, 0) == 0.0 and token_mean_kl(per_token, torch.zeros(2, 3)) == 0.0
    assert type(token_mean_kl(per_token, mask)) is float


def test_rounding_below_zero_is_clamped_and_bad_inputs_raise():
    total, count = token_kl_sum(torch.tensor([-1e-9, 0.0, 2e-3]))
    assert total.dtype == torch.float64 and total.item() == pytest.approx(2e-3)
    assert count.item() == 3
    assert token_mean_kl(torch.tensor([-1e-9, -2e-9])) == 0.0  # agreeing models: exactly 0
    with pytest.raises(ValueError, match="must have the per-token KL's shape"):
        token_mean_kl(torch.ones(2, 3), torch.ones(3, 2))
    with pytest.raises(ValueError, match="needs its token count"):
        token_mean_kl(0.5)
    with pytest.raises(ValueError, match="token count must be >= 0"):
        token_mean_kl(0.5, -1)
    with pytest.raises(ValueError, match="finite number >= 0"):
        token_mean_kl(-0.5, 2)
    with pytest.raises(ValueError, match="finite number >= 0"):
        token_mean_kl(torch.tensor([math.nan]))


def test_one_host_read_per_call():
    per_token, mask = torch.rand(4, 16), torch.rand(4, 16) > 0.5
    with HostReads() as reads:
        value = token_mean_kl(per_token, mask)
    assert reads.total == 1, dict(reads.counts)
    with HostReads() as reads:
        total, count = token_kl_sum(per_token, mask)
    assert reads.total == 0, dict(reads.counts)
    assert value == pytest.approx(float(per_token[mask].double().sum()) / int(mask.sum()))
    assert token_mean_kl(total, count) == pytest.approx(value, rel=1e-12)


def test_the_guard_reads_it_as_the_documented_loop_passes_it():
    guard = HeldOutGuard(kl_hard_stop=0.08, min_steps=1)
    per_token = torch.full((2, 5), 0.01)
    status = guard.update(0, 0.5, 0.5, kl_to_init=token_mean_kl(per_token))
    assert not status.fire and status.kl_ema == pytest.approx(0.01)
    # per token, the hard stop fires once the EMA passes 0.08 nats/token (0.9*0.01 + 0.1*0.9)
    status = guard.update(1, 0.5, 0.5, kl_to_init=token_mean_kl(torch.full((2, 5), 0.9)))
    assert status.fire and "KL-to-init EMA 0.099 nats/token" in status.reason


def test_the_training_loop_kl_to_init_is_token_mean_kl(tiny, monkeypatch):
    sys.path.insert(0, str(Path(__file__).parent / "training"))
    from test_step import _rl_sample

    from composer_replication.integrations.altered_minds import kl_logging
    from composer_replication.samples.wire import pack_samples
    from composer_replication.training import learner as learner_module
    from composer_replication.training.setup import kl_to_initial, kl_to_initial_sum

    policy, initial = copy.deepcopy(tiny[0]), copy.deepcopy(tiny[0])
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    batches = pack_samples([_rl_sample(90), _rl_sample(91, n_completion=4)], max_tokens=64)
    calls = []

    def recording(*args):
        calls.append(args)
        return token_mean_kl(*args)

    monkeypatch.setattr(kl_logging, "token_mean_kl", recording)
    with HostReads() as reads:
        got = kl_to_initial(policy, initial, batches, 1.0)
    assert reads.total == 1, dict(reads.counts)
    total, count = kl_to_initial_sum(policy, initial, batches, 1.0)
    assert calls == [(total, count)] and got == token_mean_kl(total, count) > 0
    # the learner's (data-parallel) path calls the same function on the gathered sums
    assert learner_module.token_mean_kl is token_mean_kl


def test_spread_micro_batches_picks_whole_ones_from_all_over_the_step():
    """As many micro-batches as fit the token bound, at the middles of equal intervals of
    the step's, at least one; all of them without a bound or when they fit."""
    from types import SimpleNamespace

    from composer_replication.training.setup import spread_micro_batches

    batches = [SimpleNamespace(input_ids=torch.zeros(1, 100), n=i) for i in range(10)]
    assert spread_micro_batches(batches, None) == batches
    assert spread_micro_batches(batches, 1000) == batches
    assert [b.n for b in spread_micro_batches(batches, 400)] == [1, 3, 6, 8]
    assert [b.n for b in spread_micro_batches(batches, 250)] == [2, 7]
    assert [b.n for b in spread_micro_batches(batches, 1)] == [5]  # one even if over


def test_kl_to_initial_on_a_token_bound_measures_the_picked_micro_batches(tiny):
    """A bound measures exactly the micro-batches it picks: the same sum and count as
    measuring those alone, fewer positions than the whole step."""
    sys.path.insert(0, str(Path(__file__).parent / "training"))
    from test_step import _rl_sample

    from composer_replication.samples.wire import pack_samples
    from composer_replication.training.setup import kl_to_initial_sum, spread_micro_batches

    policy, initial = copy.deepcopy(tiny[0]), copy.deepcopy(tiny[0])
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    samples = [_rl_sample(90 + k, n_completion=3 + k) for k in range(6)]
    batches = pack_samples(samples, max_tokens=16)
    assert len(batches) >= 3
    bound = batches[0].input_ids.numel() + batches[1].input_ids.numel()
    picked = spread_micro_batches(batches, bound)
    assert 1 <= len(picked) < len(batches)
    total, count = kl_to_initial_sum(policy, initial, batches, 1.0, max_tokens=bound)
    want_total, want_count = kl_to_initial_sum(policy, initial, picked, 1.0)
    _, all_count = kl_to_initial_sum(policy, initial, batches, 1.0)
    assert count == want_count < all_count
    assert total == pytest.approx(want_total, rel=1e-6) and total > 0
