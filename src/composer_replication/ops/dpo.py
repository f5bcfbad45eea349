"""DPO: the sigmoid preference loss on summed sequence log-probs, with cDPO label smoothing.

Direct Preference Optimization (Rafailov et al.; arXiv 2305.18290) trains the policy so that its
log-ratio to a frozen reference model is an implicit reward that ranks chosen above rejected:

    h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))
    L = -log sigmoid(beta * h)

Conservative DPO (cDPO; Mitchell, 2023, "A note on DPO with noisy preferences") assumes each label
is flipped with probability ``label_smoothing`` and mixes in the flipped term:

    L = -(1 - ls) * log sigmoid(beta * h) - ls * log sigmoid(-beta * h)

This is the same per-pair loss as trl's ``sigmoid`` loss with ``label_smoothing``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_REDUCTIONS = ("mean", "sum", "none")


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> Tensor:
    """Sigmoid DPO loss (arXiv 2305.18290, Eq. 7) with optional cDPO label smoothing.

    Args:
        policy_chosen_logps: (B,) summed log-prob of each chosen response under the policy
            (see :func:`sequence_logprob_sum`).
        policy_rejected_logps: (B,) same for the rejected responses.
        ref_chosen_logps: (B,) summed log-prob of the chosen responses under the reference.
        ref_rejected_logps: (B,) same for the rejected responses.
        beta: KL-regularisation strength, > 0.
        label_smoothing: assumed probability that a preference label is flipped, in [0, 0.5).
        reduction: ``"mean"`` (0-d), ``"sum"`` (0-d) or ``"none"`` ((B,) per-pair losses).

    Returns:
        The reduced loss. Gradients flow into all four inputs; pass reference log-probs computed
        under ``torch.no_grad()``.

    Raises:
        ValueError: the four shapes differ, ``beta <= 0``, ``label_smoothing`` is outside
            [0, 0.5), ``reduction`` is unknown, or the batch is empty with ``"mean"``.
    """
    _check_shapes(
        "dpo_loss", policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
    )
    if not beta > 0:
        raise ValueError(f"dpo_loss: beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo_loss: label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"dpo_loss: reduction must be one of {_REDUCTIONS}, got {reduction!r}")

    h = (policy_chosen_logps - ref_chosen_logps) - (policy_rejected_logps - ref_rejected_logps)
    logits = beta * h
    losses = -(1.0 - label_smoothing) * F.logsigmoid(logits)
    if label_smoothing > 0.0:
        losses = losses - label_smoothing * F.logsigmoid(-logits)
    if reduction == "mean":
        if losses.numel() == 0:
            raise ValueError("dpo_loss: the batch is empty; the mean is undefined")
        return losses.mean()
    if reduction == "sum":
        return losses.sum()
    return losses


def dpo_implicit_rewards(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
) -> tuple[Tensor, Tensor]:
    """DPO's implicit rewards ``beta * (log pi - log ref)`` (arXiv 2305.18290, Sec. 5), for logging.

    Args:
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps:
            (B,) summed sequence log-probs, as for :func:`dpo_loss`.
        beta: the same beta as the loss, > 0.

    Returns:
        ``(chosen_rewards, rejected_rewards)``, each (B,) and detached from the graph.
        Reward accuracy is ``(chosen_rewards > rejected_rewards).float().mean()``.

    Raises:
        ValueError: the four shapes differ or ``beta <= 0``.
    """
    _check_shapes(
        "dpo_implicit_rewards",
        policy_chosen_logps,
        policy_rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
    )
    if not beta > 0:
        raise ValueError(f"dpo_implicit_rewards: beta must be > 0, got {beta}")
    chosen = beta * (policy_chosen_logps - ref_chosen_logps).detach()
    rejected = beta * (policy_rejected_logps - ref_rejected_logps).detach()
    return chosen, rejected


def sequence_logprob_sum(token_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """Summed log-prob of the response tokens of each sequence: DPO's ``log pi(y | x)``.

    Args:
        token_logprobs: (B, T) log-prob of each realised token.
        response_mask: (B, T) bool or 0/1 tensor; 1 marks a response token.

    Returns:
        (B,) ``sum_t mask * logp``; a row with no response token sums to 0.0. Positions outside
        the mask are selected away, never multiplied, so ``-inf`` padding cannot make NaN.

    Raises:
        ValueError: the shapes differ, the inputs are not 2-D, or the mask holds values
            other than 0 and 1.
    """
    if token_logprobs.dim() != 2:
        raise ValueError(
            f"sequence_logprob_sum: token_logprobs must be (B, T), got {tuple(token_logprobs.shape)}"
        )
    if response_mask.shape != token_logprobs.shape:
        raise ValueError(
            f"sequence_logprob_sum: response_mask shape {tuple(response_mask.shape)} must equal "
            f"token_logprobs shape {tuple(token_logprobs.shape)}"
        )
    if response_mask.dtype != torch.bool:
        if not bool(((response_mask == 0) | (response_mask == 1)).all()):
            raise ValueError(
                "sequence_logprob_sum: response_mask must be bool or hold only 0/1; for labels "
                "with -100 pass `labels != -100`"
            )
        response_mask = response_mask != 0
    zeros = torch.zeros_like(token_logprobs)
    return torch.where(response_mask, token_logprobs, zeros).sum(dim=-1)


def _check_shapes(fn: str, pc: Tensor, pr: Tensor, rc: Tensor, rr: Tensor) -> None:
    shapes = {
        "policy_chosen_logps": tuple(pc.shape),
        "policy_rejected_logps": tuple(pr.shape),
        "ref_chosen_logps": tuple(rc.shape),
        "ref_rejected_logps": tuple(rr.shape),
    }
    if len(set(shapes.values())) != 1:
        listed = ", ".join(f"{name}={shape}" for name, shape in shapes.items())
        raise ValueError(f"{fn}: all four log-prob tensors must have the same shape, got {listed}")
