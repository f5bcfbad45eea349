"""Sigmoid DPO with cDPO smoothing, against hand values and trl's sigmoid preference loss."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

from composer_replication.distillation import (
    dpo_implicit_rewards,
    dpo_loss,
    sequence_logprob_sum,
)

PC = [-10.0, -7.0, -12.0]
PR = [-12.0, -6.0, -12.5]
RC = [-11.0, -7.5, -11.0]
RR = [-11.5, -6.5, -13.0]


def _inputs(dtype=torch.float32, requires_grad=False):
    return [torch.tensor(x, dtype=dtype, requires_grad=requires_grad) for x in (PC, PR, RC, RR)]


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def _hand_losses(beta: float, ls: float) -> list[float]:
    out = []
    for pc, pr, rc, rr in zip(PC, PR, RC, RR, strict=True):
        h = (pc - rc) - (pr - rr)
        out.append(-(1 - ls) * _log_sigmoid(beta * h) - ls * _log_sigmoid(-beta * h))
    return out


def test_dpo_loss_matches_hand_computed_values():
    # h = [1.5, -0.5, -1.5]
    expected = _hand_losses(beta=0.1, ls=0.0)
    assert expected[0] == pytest.approx(math.log1p(math.exp(-0.15)), rel=1e-12)
    losses = dpo_loss(*_inputs(torch.float64), reduction="none")
    torch.testing.assert_close(losses, torch.tensor(expected, dtype=torch.float64))
    mean = dpo_loss(*_inputs())
    assert mean.item() == pytest.approx(sum(expected) / 3, rel=1e-6)
    total = dpo_loss(*_inputs(), reduction="sum")
    assert total.item() == pytest.approx(sum(expected), rel=1e-6)


def test_dpo_loss_label_smoothing_matches_hand_computed_values():
    expected = _hand_losses(beta=0.5, ls=0.2)
    losses = dpo_loss(*_inputs(torch.float64), beta=0.5, label_smoothing=0.2, reduction="none")
    torch.testing.assert_close(losses, torch.tensor(expected, dtype=torch.float64))


def test_dpo_loss_matches_trl_sigmoid_loss():
    # trl 1.16 has no free function for DPO's loss; CPOTrainer.cpo_loss applies the same
    # smoothed sigmoid loss to whatever log-ratios it is given, so feed it the DPO log-ratios.
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.cpo import CPOTrainer

    torch.manual_seed(0)
    pc, pr, rc, rr = (-torch.rand(8, dtype=torch.float64) * 20 for _ in range(4))
    for beta, ls in [(0.1, 0.0), (0.5, 0.1), (2.0, 0.3)]:
        trainer = SimpleNamespace(
            alpha=0.0,
            beta=beta,
            loss_type="sigmoid",
            label_smoothing=ls,
            accelerator=SimpleNamespace(device="cpu"),
        )
        trl_losses, _, _ = CPOTrainer.cpo_loss(trainer, pc - rc, pr - rr)
        ours = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=ls, reduction="none")
        torch.testing.assert_close(ours, trl_losses, rtol=1e-12, atol=1e-12)


def test_dpo_loss_gradient_matches_closed_form():
    beta, ls = 0.5, 0.2
    pc, pr, rc, rr = _inputs(torch.float64, requires_grad=True)
    dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=ls, reduction="sum").backward()
    expected = []
    for c, r, c_ref, r_ref in zip(PC, PR, RC, RR, strict=True):
        z = beta * ((c - c_ref) - (r - r_ref))
        sig = 1 / (1 + math.exp(-z))
        # d/dz of -(1-ls) log s(z) - ls log s(-z) = -(1-ls)(1-s(z)) + ls s(z)
        expected.append((-(1 - ls) * (1 - sig) + ls * sig) * beta)
    expected_t = torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(pc.grad, expected_t)
    torch.testing.assert_close(pr.grad, -expected_t)
    torch.testing.assert_close(rc.grad, -expected_t)
    torch.testing.assert_close(rr.grad, expected_t)


def test_dpo_implicit_rewards_are_scaled_detached_log_ratios():
    pc, pr, rc, rr = _inputs(torch.float64, requires_grad=True)
    chosen, rejected = dpo_implicit_rewards(pc, pr, rc, rr, beta=0.1)
    torch.testing.assert_close(chosen, torch.tensor([0.1, 0.05, -0.1], dtype=torch.float64))
    torch.testing.assert_close(rejected, torch.tensor([-0.05, 0.05, 0.05], dtype=torch.float64))
    assert not chosen.requires_grad
    assert not rejected.requires_grad


def test_sequence_logprob_sum_sums_masked_tokens():
    logprobs = torch.tensor([[-1.0, -2.0, float("-inf")], [-0.5, -0.25, -4.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [0, 0, 0]])
    out = sequence_logprob_sum(logprobs, mask)
    assert out.tolist() == [-3.0, -4.25, 0.0]
    torch.testing.assert_close(sequence_logprob_sum(logprobs, mask.bool()), out)


def test_dpo_rejects_bad_arguments():
    pc, pr, rc, rr = _inputs()
    with pytest.raises(ValueError, match=r"ref_rejected_logps=\(2,\)"):
        dpo_loss(pc, pr, rc, torch.zeros(2))
    with pytest.raises(ValueError, match="same shape"):
        dpo_implicit_rewards(pc, pr, torch.zeros(1), rr)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(pc, pr, rc, rr, beta=0.0)
    with pytest.raises(ValueError, match="beta"):
        dpo_implicit_rewards(pc, pr, rc, rr, beta=-1.0)
    for bad in (-0.1, 0.5, 0.7):
        with pytest.raises(ValueError, match="label_smoothing"):
            dpo_loss(pc, pr, rc, rr, label_smoothing=bad)
    with pytest.raises(ValueError, match="'batchmean'"):
        dpo_loss(pc, pr, rc, rr, reduction="batchmean")
    with pytest.raises(ValueError, match="empty"):
        dpo_loss(*(torch.zeros(0) for _ in range(4)))
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 2\)"):
        sequence_logprob_sum(torch.zeros(2, 2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="0/1"):
        sequence_logprob_sum(torch.zeros(1, 2), torch.tensor([[2, 1]]))
