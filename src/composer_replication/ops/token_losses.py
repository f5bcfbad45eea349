"""The fixed loss components the trainer executes, as pure functions.

Each returns ``(loss_sum, count)``: the component's sum over its weight stream and the
number of tokens (pairs) it counts, so the trainer can normalise every component by its own
global count (components never dilute each other). Inputs are (B, T) or flat tensors of the
same shape. Notation: ``lp`` trainer log-prob of the sampled token,
``lp_inf`` the sampler's, ``log_r = lp - lp_inf``, ``r = exp(log_r)``,
``dp = exp(lp) - exp(lp_inf)``.

The ``rl`` default is the binary total-variation trust region of DPPO (Qi et al., arXiv
2602.04879: mask on the probability difference instead of ratio clipping) plus a KL penalty
on the importance ratio, as in PRIME-RL's default loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from composer_replication.ops.trust_region import outside_trust_region

if TYPE_CHECKING:
    from torch import Tensor


def _same_shape(**tensors: Tensor | None) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"component inputs must share one shape, got {shapes}")


def _check_knobs(**knobs: float) -> None:
    for name, value in knobs.items():
        if value < 0:
            raise ValueError(f"{name}={value} must be >= 0")


def dppo_keep_mask(
    logprobs: Tensor,
    inference_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    mask_low: float = 0.2,
    mask_high: float = 0.2,
) -> Tensor:
    """Tokens the rl term keeps: trainable and inside the probability-difference trust region.

    A token is dropped when ``A > 0 and dp > mask_high`` (already much more likely than when
    sampled) or ``A <= 0 and dp < -mask_low`` (already much less likely).
    """
    with torch.no_grad():
        dp = logprobs.detach().exp() - inference_logprobs.exp()
        dropped = ((advantages > 0) & (dp > mask_high)) | ((advantages <= 0) & (dp < -mask_low))
        return (loss_mask != 0) & ~dropped


def rl_loss(
    logprobs: Tensor,
    inference_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    weights: Tensor | None = None,
    *,
    mask_low: float = 0.2,
    mask_high: float = 0.2,
    adv_tau: float = 1.0,
    kl_tau: float = 1e-3,
) -> tuple[Tensor, Tensor]:
    """``sum w * (-keep * adv_tau * A * r + kl_tau * m * log_r^2)`` and its token count.

    ``weights`` None means 1 on every token; the count is the trainable tokens with a
    non-zero weight.
    """
    _same_shape(
        logprobs=logprobs,
        inference_logprobs=inference_logprobs,
        advantages=advantages,
        loss_mask=loss_mask,
        weights=weights,
    )
    _check_knobs(mask_low=mask_low, mask_high=mask_high, adv_tau=adv_tau, kl_tau=kl_tau)
    mask = (loss_mask != 0).to(logprobs.dtype)
    w = torch.ones_like(logprobs) if weights is None else weights.to(logprobs.dtype)
    keep = dppo_keep_mask(
        logprobs, inference_logprobs, advantages, loss_mask, mask_low=mask_low, mask_high=mask_high
    ).to(logprobs.dtype)
    log_r = logprobs - inference_logprobs
    per_token = -keep * adv_tau * advantages * log_r.exp() + kl_tau * mask * log_r.square()
    count = ((loss_mask != 0) & (w != 0)).sum()
    return (w * per_token).sum(), count


def ref_kl_loss(
    logprobs: Tensor,
    inference_logprobs: Tensor,
    ref_logprobs: Tensor,
    loss_mask: Tensor,
    weights: Tensor | None = None,
    *,
    mask_low: float = 0.2,
    kl_tau: float = 1e-3,
) -> tuple[Tensor, Tensor]:
    """Reverse KL to a reference as the policy-gradient signal (on-policy distillation).

    ``keep = m and not (dp < -mask_low)``;
    ``sum w * (-keep * stopgrad(lp_ref - lp) * r + kl_tau * m * log_r^2)``.
    """
    _same_shape(
        logprobs=logprobs,
        inference_logprobs=inference_logprobs,
        ref_logprobs=ref_logprobs,
        loss_mask=loss_mask,
        weights=weights,
    )
    _check_knobs(mask_low=mask_low, kl_tau=kl_tau)
    mask = (loss_mask != 0).to(logprobs.dtype)
    w = torch.ones_like(logprobs) if weights is None else weights.to(logprobs.dtype)
    with torch.no_grad():
        outside = outside_trust_region(logprobs, inference_logprobs, mask_low)
        keep = ((loss_mask != 0) & ~outside).to(logprobs.dtype)
        signal = ref_logprobs - logprobs.detach()
    log_r = logprobs - inference_logprobs
    per_token = -keep * signal * log_r.exp() + kl_tau * mask * log_r.square()
    count = ((loss_mask != 0) & (w != 0)).sum()
    return (w * per_token).sum(), count


def ce_loss(logprobs: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """``sum over w != 0 of -w * lp`` and the number of tokens with a non-zero weight."""
    _same_shape(logprobs=logprobs, weights=weights)
    w = weights.to(logprobs.dtype)
    return -(w * logprobs).sum(), (w != 0).sum()


def weighted_token_loss(values: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """``sum w * values`` over tokens with ``w != 0`` (the ``jsd`` component)."""
    _same_shape(values=values, weights=weights)
    w = weights.to(values.dtype)
    return (w * values).sum(), (w != 0).sum()


def k2_trust_mask(logprobs: Tensor, ref_logprobs: Tensor, threshold: float = 0.08) -> Tensor:
    """Tensor form of ``safety.kl_token_trust_filter``: True where a token must be masked.

    ``0.5 * (lp - lp_ref)^2 > threshold``; NaN estimates are masked too (fail closed).
    """
    if not threshold >= 0:
        raise ValueError(f"threshold={threshold} must be >= 0")
    k2 = 0.5 * (logprobs.detach() - ref_logprobs).square()
    return ~(k2 <= threshold)
