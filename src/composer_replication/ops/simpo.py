"""SimPO: reference-free preference optimisation on length-normalised log-probs.

SimPO (Meng, Xia, Chen; arXiv 2405.14734) scores a response by its *average* per-token
log-probability under the policy and asks the chosen response to beat the rejected one by a
target margin ``gamma``:

    L = -log sigmoid(beta * (avg_logp(chosen) - avg_logp(rejected)) - gamma)

There is no reference model. ``avg_sequence_logprob`` turns per-token log-probs into the
length-normalised score the loss expects.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def simpo_loss(
    chosen_avg_logprobs: Tensor,
    rejected_avg_logprobs: Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 1.0,
    reduction: str = "mean",
) -> Tensor:
    """SimPO loss, averaged over the batch (arXiv 2405.14734, Eq. 6).

    ``mean_b -log sigmoid(beta * (chosen[b] - rejected[b]) - gamma)``

    Args:
        chosen_avg_logprobs: (B,) average per-token log-prob of each chosen response
            (see :func:`avg_sequence_logprob`).
        rejected_avg_logprobs: (B,) same for the rejected responses.
        beta: reward scale, > 0. The paper's defaults are in [2.0, 2.5].
        gamma: target reward margin (in reward units, i.e. already multiplied by beta).
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"`` ((B,) per-pair losses).

    Returns:
        0-d tensor (or (B,) for ``"none"``), differentiable in both inputs.

    Raises:
        ValueError: the two inputs differ in shape, the batch is empty, ``beta <= 0``, or
            ``reduction`` is unknown.
    """
    if chosen_avg_logprobs.shape != rejected_avg_logprobs.shape:
        raise ValueError(
            "simpo_loss: chosen_avg_logprobs and rejected_avg_logprobs must have the same "
            f"shape, got {tuple(chosen_avg_logprobs.shape)} and "
            f"{tuple(rejected_avg_logprobs.shape)}"
        )
    if chosen_avg_logprobs.numel() == 0:
        raise ValueError("simpo_loss: the batch is empty; pass at least one preference pair")
    if not beta > 0:
        raise ValueError(f"simpo_loss: beta must be > 0, got {beta}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"simpo_loss: reduction must be mean, sum or none, got {reduction!r}")
    margin = beta * (chosen_avg_logprobs - rejected_avg_logprobs) - gamma
    losses = -F.logsigmoid(margin)
    if reduction == "none":
        return losses
    return losses.sum() if reduction == "sum" else losses.mean()


def avg_sequence_logprob(model_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """Mean log-prob over the response tokens of each sequence (SimPO's score, arXiv 2405.14734).

    Args:
        model_logprobs: (B, T) log-prob of each realised token under the policy.
        response_mask: (B, T) bool or 0/1 tensor; 1 marks a response token that counts.

    Returns:
        (B,) ``sum_t mask * logp / sum_t mask``. A row with no response token returns exactly
        0.0, with a zero (finite) gradient, rather than 0/0 = NaN. Positions outside the mask
        are never multiplied, so a ``-inf`` or NaN there (e.g. padding) cannot leak in.

    Raises:
        ValueError: the shapes differ, the inputs are not 2-D, or the mask holds values
            other than 0 and 1.
    """
    mask = _bool_mask(model_logprobs, response_mask, "avg_sequence_logprob")
    total = torch.where(mask, model_logprobs, torch.zeros_like(model_logprobs)).sum(dim=-1)
    count = mask.sum(dim=-1).clamp(min=1).to(total.dtype)
    return total / count


def _bool_mask(values: Tensor, mask: Tensor, fn: str) -> Tensor:
    """Check a (B, T) 0/1 mask against (B, T) values and return it as bool."""
    if values.dim() != 2:
        raise ValueError(f"{fn}: model_logprobs must be (B, T), got {tuple(values.shape)}")
    if mask.shape != values.shape:
        raise ValueError(
            f"{fn}: response_mask shape {tuple(mask.shape)} must equal model_logprobs shape "
            f"{tuple(values.shape)}"
        )
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(
                f"{fn}: response_mask must be bool or hold only 0/1; for labels with -100 "
                "pass `labels != -100`"
            )
        mask = mask != 0
    return mask
