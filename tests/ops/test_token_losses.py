"""Loss components against the formulas of 02-algorithms.md §1, element by element."""

from __future__ import annotations

import math

import pytest
import torch

from composer_replication.ops.token_losses import (
    ce_loss,
    dppo_keep_mask,
    k2_trust_mask,
    ref_kl_loss,
    rl_loss,
    weighted_token_loss,
)


def _random(seed: int, n: int = 40):
    gen = torch.Generator().manual_seed(seed)
    lp = -torch.rand(n, generator=gen, dtype=torch.float64) * 3
    lp_inf = lp + 0.6 * torch.randn(n, generator=gen, dtype=torch.float64)
    lp_inf = lp_inf.clamp(max=-1e-3)
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    adv[::7] = 0.0
    mask = (torch.rand(n, generator=gen) > 0.2).long()
    weights = torch.rand(n, generator=gen, dtype=torch.float64) * 2
    weights[::5] = 0.0
    ref = lp + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)
    return lp, lp_inf, adv, mask, weights, ref


def _rl_by_hand(lp, lp_inf, adv, mask, w, lo, hi, adv_tau, kl_tau):
    total, count = 0.0, 0
    for a, b, A, m, wi in zip(lp.tolist(), lp_inf.tolist(), adv.tolist(), mask.tolist(), w):
        dp = math.exp(a) - math.exp(b)
        dropped = (A > 0 and dp > hi) or (A <= 0 and dp < -lo)
        keep = 1.0 if (m and not dropped) else 0.0
        log_r = a - b
        total += wi * (-keep * adv_tau * A * math.exp(log_r) + kl_tau * m * log_r**2)
        count += int(m != 0 and wi != 0)
    return total, count


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("lo", "hi", "adv_tau", "kl_tau"), [(0.2, 0.2, 1.0, 1e-3), (0.05, 0.3, 0.5, 0.1)]
)
def test_rl_loss_matches_formula(seed, lo, hi, adv_tau, kl_tau):
    lp, lp_inf, adv, mask, w, _ = _random(seed)
    got, count = rl_loss(
        lp, lp_inf, adv, mask, w, mask_low=lo, mask_high=hi, adv_tau=adv_tau, kl_tau=kl_tau
    )
    expected, expected_count = _rl_by_hand(
        lp, lp_inf, adv, mask, w.tolist(), lo, hi, adv_tau, kl_tau
    )
    assert float(got) == pytest.approx(expected, abs=1e-12)
    assert int(count) == expected_count


def test_rl_trust_region_drops_tokens_and_their_gradient():
    lp = torch.tensor(
        [math.log(0.9), math.log(0.1), math.log(0.5)], dtype=torch.float64, requires_grad=True
    )
    lp_inf = torch.tensor([math.log(0.5), math.log(0.5), math.log(0.45)], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    mask = torch.ones(3)
    keep = dppo_keep_mask(lp, lp_inf, adv, mask)
    assert keep.tolist() == [False, False, True]  # dp=+0.4 with A>0; dp=-0.4 with A<0
    loss, _ = rl_loss(lp, lp_inf, adv, mask, kl_tau=0.0)
    loss.backward()
    assert lp.grad[0] == 0 and lp.grad[1] == 0
    assert float(lp.grad[2]) == pytest.approx(-0.5 / 0.45, rel=1e-12)  # -A * r


def test_all_ones_rl_stream_equals_absent_stream():
    lp, lp_inf, adv, mask, _, _ = _random(3)
    absent = rl_loss(lp, lp_inf, adv, mask)
    ones = rl_loss(lp, lp_inf, adv, mask, torch.ones_like(lp))
    assert float(absent[0]) == float(ones[0]) and int(absent[1]) == int(ones[1])


def _ref_kl_by_hand(lp, lp_inf, ref, mask, w, lo, kl_tau):
    total, count = 0.0, 0
    for a, b, c, m, wi in zip(lp.tolist(), lp_inf.tolist(), ref.tolist(), mask.tolist(), w):
        dp = math.exp(a) - math.exp(b)
        keep = 1.0 if (m and not dp < -lo) else 0.0
        log_r = a - b
        total += wi * (-keep * (c - a) * math.exp(log_r) + kl_tau * m * log_r**2)
        count += int(m != 0 and wi != 0)
    return total, count


@pytest.mark.parametrize("seed", [0, 4])
def test_ref_kl_loss_matches_formula_and_gradient(seed):
    lp, lp_inf, _, mask, w, ref = _random(seed)
    lp = lp.clone().requires_grad_()
    got, count = ref_kl_loss(lp, lp_inf, ref, mask, w, mask_low=0.2, kl_tau=0.01)
    expected, expected_count = _ref_kl_by_hand(
        lp.detach(), lp_inf, ref, mask, w.tolist(), 0.2, 0.01
    )
    assert float(got) == pytest.approx(expected, abs=1e-12) and int(count) == expected_count
    got.backward()
    # stopgrad(ref - lp): d/dlp of -keep*(ref-lp)*r is -keep*(ref-lp)*r only through r
    dp = lp.detach().exp() - lp_inf.exp()
    keep = ((mask != 0) & ~(dp < -0.2)).double()
    r = (lp.detach() - lp_inf).exp()
    grad = w * (-keep * (ref - lp.detach()) * r + 0.01 * mask * 2 * (lp.detach() - lp_inf))
    torch.testing.assert_close(lp.grad, grad, atol=1e-9, rtol=1e-8)


def test_ce_and_weighted_token_loss():
    lp = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64)
    w = torch.tensor([1.0, 0.0, 0.1, 2.0], dtype=torch.float64)
    total, count = ce_loss(lp, w)
    assert float(total) == pytest.approx(1.0 + 0.05 + 6.0) and int(count) == 3
    total, count = weighted_token_loss(torch.tensor([0.5, 9.0, 1.0, 2.0]), w.float())
    assert float(total) == pytest.approx(0.5 + 0.1 + 4.0) and int(count) == 3


def test_k2_trust_mask_matches_pure_python_filter():
    from composer_replication.safety import kl_token_trust_filter

    lp = torch.tensor([-1.0, -1.0, -1.0, float("nan")])
    ref = torch.tensor([-1.0, -1.4, -1.5, -1.0])
    got = k2_trust_mask(lp, ref, 0.08).tolist()
    expected = [
        kl_token_trust_filter(0.5 * (a - b) ** 2, 0.08) for a, b in zip(lp.tolist(), ref.tolist())
    ]
    assert got == expected == [False, False, True, True]


def test_shape_mismatch_and_bad_knobs_raise():
    lp, lp_inf, adv, mask, w, _ = _random(0)
    with pytest.raises(ValueError, match="shape"):
        rl_loss(lp, lp_inf[:-1], adv, mask)
    with pytest.raises(ValueError, match="kl_tau"):
        rl_loss(lp, lp_inf, adv, mask, kl_tau=-1)
    with pytest.raises(ValueError, match="shape"):
        ce_loss(lp, w[:-1])
