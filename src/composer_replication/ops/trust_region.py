"""Trust-region diagnostics of the ``ref_kl`` component, as PRIME-RL logs them.

Notation as in the loss components: ``lp`` trainer log-prob of the sampled token, ``lp_inf``
the sampler's, ``lp_ref`` the reference's, ``log_r = lp - lp_inf``, ``r = exp(log_r)``,
``dp = exp(lp) - exp(lp_inf)``. The ``ref_kl`` loss keeps a token in its policy-gradient
term unless ``dp < -mask_low`` (one-sided trust region: the trainer already finds the token
much less likely than the sampler did).

Per sample (one packed row), over the tokens the ``ref_kl`` loss trains (``loss_mask`` and
a non-zero weight):

- ``ref_kl``: mean of ``lp_ref - lp``, the per-token signal the loss follows (its negative
  is the k1 estimate of KL(policy || reference) on the sampled tokens);
- ``ref_kl/is_masked``: the share of those tokens outside the trust region;
- ``ref_kl/masked_mismatch_kl`` / ``ref_kl/unmasked_mismatch_kl``: mean of
  ``r - log_r - 1`` (the k3 estimate of KL(sampler || trainer), :func:`mismatch_kl`) over
  the masked / the kept tokens, 0.0 when there are none.

A step reports each as the mean over its samples that have ``ref_kl`` tokens, under the
name with ``/mean`` appended (``ref_kl/mean``, ``ref_kl/is_masked/mean``,
``ref_kl/masked_mismatch_kl/mean``, ``ref_kl/unmasked_mismatch_kl/mean``), and reports
nothing when no sample has any.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import Tensor

#: Per-sample metric names (a step logs each with ``/mean`` appended).
REF_KL_SAMPLE_METRICS = (
    "ref_kl",
    "ref_kl/is_masked",
    "ref_kl/masked_mismatch_kl",
    "ref_kl/unmasked_mismatch_kl",
)


def outside_trust_region(logprobs: Tensor, inference_logprobs: Tensor, mask_low: float) -> Tensor:
    """Per token ``dp < -mask_low`` (no grad): the tokens the ``ref_kl`` loss drops from its
    policy-gradient term because the trainer finds them much less likely than the sampler."""
    with torch.no_grad():
        return logprobs.detach().exp() - inference_logprobs.exp() < -mask_low


def mismatch_kl(logprobs: Tensor, inference_logprobs: Tensor) -> Tensor:
    """Per token ``r - log_r - 1``: the k3 estimate of KL(sampler || trainer), >= 0."""
    log_r = logprobs - inference_logprobs
    return log_r.exp() - log_r - 1


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Row-wise mean of ``values`` over ``mask`` (0.0 for a row where the mask is empty)."""
    m = mask.to(values.dtype)
    return (values * m).sum(-1) / m.sum(-1).clamp_min(1.0)


def ref_kl_row_metrics(
    logprobs: Tensor,
    inference_logprobs: Tensor,
    ref_logprobs: Tensor,
    loss_mask: Tensor,
    weights: Tensor | None = None,
    *,
    mask_low: float = 0.2,
) -> tuple[dict[str, Tensor], Tensor]:
    """Per-row trust-region metrics of the ``ref_kl`` component (no grad), for every row.

    Same arguments as :func:`ref_kl_sample_metrics`. Returns ``(values, has_tokens)``:
    ``REF_KL_SAMPLE_METRICS`` -> (B,) per-row values (0.0 on rows without ``ref_kl``
    tokens) and the (B,) boolean of the rows that have any. Nothing is read back from the
    device (selecting the rows would need their number on the host).
    """
    tensors = {
        "logprobs": logprobs,
        "inference_logprobs": inference_logprobs,
        "ref_logprobs": ref_logprobs,
        "loss_mask": loss_mask,
        "weights": weights,
    }
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"ref_kl metric inputs must share one shape, got {shapes}")
    if not mask_low >= 0:
        raise ValueError(f"mask_low={mask_low} must be >= 0")
    with torch.no_grad():
        lp = logprobs.detach()
        if lp.dim() == 1:
            lp, inference_logprobs, ref_logprobs, loss_mask = (
                t.unsqueeze(0) for t in (lp, inference_logprobs, ref_logprobs, loss_mask)
            )
            weights = None if weights is None else weights.unsqueeze(0)
        tokens = loss_mask != 0
        if weights is not None:
            tokens = tokens & (weights != 0)
        masked = tokens & outside_trust_region(lp, inference_logprobs, mask_low)
        kept = tokens & ~masked
        mkl = mismatch_kl(lp, inference_logprobs)
        values = {
            "ref_kl": _masked_mean(ref_logprobs - lp, tokens),
            "ref_kl/is_masked": _masked_mean(masked.to(lp.dtype), tokens),
            "ref_kl/masked_mismatch_kl": _masked_mean(mkl, masked),
            "ref_kl/unmasked_mismatch_kl": _masked_mean(mkl, kept),
        }
        return values, tokens.any(-1)


def ref_kl_sample_metrics(
    logprobs: Tensor,
    inference_logprobs: Tensor,
    ref_logprobs: Tensor,
    loss_mask: Tensor,
    weights: Tensor | None = None,
    *,
    mask_low: float = 0.2,
) -> dict[str, Tensor]:
    """Per-sample trust-region metrics of the ``ref_kl`` component (no grad).

    Args:
        logprobs, inference_logprobs, ref_logprobs, loss_mask: (B, T) rows (one sample
            each) or one flat (T,) sample, as the ``ref_kl`` loss receives them.
        weights: the ``ref_kl`` weight stream (None: 1 on every token).
        mask_low: the loss's trust-region bound.

    Returns:
        ``REF_KL_SAMPLE_METRICS`` -> a (S,) tensor, one value per sample that has at least
        one ``ref_kl`` token (samples without any are left out).
    """
    values, rows = ref_kl_row_metrics(
        logprobs, inference_logprobs, ref_logprobs, loss_mask, weights, mask_low=mask_low
    )
    return {name: value[rows] for name, value in values.items()}


def ref_kl_row_sums(values: dict[str, Tensor], has_tokens: Tensor) -> dict[str, Tensor]:
    """``<metric>/sum`` and ``<metric>/n`` over the rows that have ``ref_kl`` tokens, as
    float64 device scalars (from :func:`ref_kl_row_metrics`; masked sums, no row selection)."""
    n = has_tokens.sum().double()
    out: dict[str, Tensor] = {}
    for name in REF_KL_SAMPLE_METRICS:
        # where, not a product: a row without tokens adds 0 even if its value is not finite
        out[f"{name}/sum"] = torch.where(has_tokens, values[name].double(), 0.0).sum()
        out[f"{name}/n"] = n
    return out


def ref_kl_step_sums(per_sample: Sequence[dict[str, Tensor]]) -> dict[str, float]:
    """For each metric, the sum over a step's samples and their number (``<metric>/sum``,
    ``<metric>/n``; zeros without ``ref_kl`` tokens): what data-parallel ranks add up."""
    out: dict[str, float] = {}
    for name in REF_KL_SAMPLE_METRICS:
        values = [part[name].reshape(-1).double() for part in per_sample if name in part]
        joined = torch.cat(values) if values else None
        out[f"{name}/sum"] = float(joined.sum()) if joined is not None else 0.0
        out[f"{name}/n"] = float(joined.numel()) if joined is not None else 0.0
    return out


def ref_kl_metrics_from_sums(sums: dict[str, float]) -> dict[str, float]:
    """``<metric>/mean`` from :func:`ref_kl_step_sums` (of one rank or summed over ranks);
    metrics without samples are left out."""
    return {
        f"{name}/mean": sums[f"{name}/sum"] / sums[f"{name}/n"]
        for name in REF_KL_SAMPLE_METRICS
        if sums.get(f"{name}/n")
    }


def ref_kl_step_metrics(per_sample: Sequence[dict[str, Tensor]]) -> dict[str, float]:
    """Means over a step's samples (parts from :func:`ref_kl_sample_metrics`, e.g. one per
    micro-batch), named ``<metric>/mean``; empty when no sample had ``ref_kl`` tokens."""
    return ref_kl_metrics_from_sums(ref_kl_step_sums(per_sample))
