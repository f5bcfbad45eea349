"""SimPO loss and the average sequence log-prob, against hand values and trl's CPO/SimPO loss."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

from composer_replication.distillation import avg_sequence_logprob, simpo_loss


def _neg_logsigmoid(x: float) -> float:
    return math.log1p(math.exp(-x))


def test_simpo_loss_matches_hand_computed_value():
    chosen = torch.tensor([-1.0, -0.5])
    rejected = torch.tensor([-2.0, -0.3])
    # margins: 2 * 1.0 - 1 = 1.0 and 2 * (-0.2) - 1 = -1.4
    expected = (_neg_logsigmoid(1.0) + _neg_logsigmoid(-1.4)) / 2
    assert simpo_loss(chosen, rejected).item() == pytest.approx(expected, rel=1e-6)
    assert expected == pytest.approx((0.3132616875 + 1.6204174099) / 2, rel=1e-9)


def test_simpo_loss_custom_beta_gamma():
    chosen = torch.tensor([-0.7], dtype=torch.float64)
    rejected = torch.tensor([-1.1], dtype=torch.float64)
    loss = simpo_loss(chosen, rejected, beta=2.5, gamma=0.3)
    assert loss.item() == pytest.approx(_neg_logsigmoid(2.5 * 0.4 - 0.3), rel=1e-12)


def test_simpo_loss_matches_trl_cpo_simpo_loss():
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.cpo import CPOTrainer

    torch.manual_seed(0)
    chosen = -torch.rand(6, dtype=torch.float64) * 3
    rejected = -torch.rand(6, dtype=torch.float64) * 3
    for beta, gamma in [(2.0, 1.0), (2.5, 0.5), (10.0, 3.0)]:
        trainer = SimpleNamespace(
            alpha=0.0,
            beta=beta,
            simpo_gamma=gamma,
            loss_type="simpo",
            label_smoothing=0.0,
            accelerator=SimpleNamespace(device="cpu"),
        )
        trl_losses, _, _ = CPOTrainer.cpo_loss(trainer, chosen, rejected)
        ours = simpo_loss(chosen, rejected, beta=beta, gamma=gamma)
        torch.testing.assert_close(ours, trl_losses.mean(), rtol=1e-12, atol=1e-12)


def test_simpo_loss_gradient_matches_closed_form():
    chosen = torch.tensor([-1.0, -0.5], requires_grad=True)
    rejected = torch.tensor([-2.0, -0.3], requires_grad=True)
    simpo_loss(chosen, rejected).backward()
    # d/dc of -logsigmoid(beta * (c - r) - gamma) / B is -beta * sigmoid(-margin) / B
    margins = [1.0, -1.4]
    expected = [-2.0 / (1 + math.exp(m)) / 2 for m in margins]
    torch.testing.assert_close(chosen.grad, torch.tensor(expected))
    torch.testing.assert_close(rejected.grad, -torch.tensor(expected))


def test_simpo_loss_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"\(3,\).*\(2,\)"):
        simpo_loss(torch.zeros(3), torch.zeros(2))


def test_simpo_loss_rejects_bad_beta_and_empty_batch():
    with pytest.raises(ValueError, match="beta"):
        simpo_loss(torch.zeros(2), torch.zeros(2), beta=0.0)
    with pytest.raises(ValueError, match="empty"):
        simpo_loss(torch.zeros(0), torch.zeros(0))


def test_avg_sequence_logprob_means_over_masked_tokens():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, -4.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    out = avg_sequence_logprob(logprobs, mask)
    torch.testing.assert_close(out, torch.tensor([-1.5, -2.125]))
    torch.testing.assert_close(avg_sequence_logprob(logprobs, mask.bool()), out)
    torch.testing.assert_close(avg_sequence_logprob(logprobs, mask.float()), out)


def test_avg_sequence_logprob_empty_row_is_zero_with_finite_gradient():
    logprobs = torch.tensor([[-1.0, -3.0], [-2.0, float("-inf")]], requires_grad=True)
    mask = torch.tensor([[True, True], [False, False]])
    out = avg_sequence_logprob(logprobs, mask)
    assert out.tolist() == [-2.0, 0.0]
    out.sum().backward()
    assert torch.isfinite(logprobs.grad).all()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.5, 0.5], [0.0, 0.0]]))


def test_avg_sequence_logprob_ignores_non_finite_padding():
    logprobs = torch.tensor([[-1.0, float("-inf"), float("nan")]], requires_grad=True)
    out = avg_sequence_logprob(logprobs, torch.tensor([[1, 0, 0]]))
    assert out.item() == -1.0
    out.backward()
    assert logprobs.grad.tolist() == [[1.0, 0.0, 0.0]]


def test_avg_sequence_logprob_validates_inputs():
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 2\)"):
        avg_sequence_logprob(torch.zeros(2, 2), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        avg_sequence_logprob(torch.zeros(4), torch.ones(4))
    with pytest.raises(ValueError, match="0/1"):
        avg_sequence_logprob(torch.zeros(1, 2), torch.tensor([[1, -100]]))
