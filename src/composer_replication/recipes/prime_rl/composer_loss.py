"""Our ``rl`` loss as a PRIME-RL custom loss, plus the SDPO reference-KL term.

PRIME-RL calls its ``rl`` loss once per packed sample with 1-D tensors (an object with
``trainer_logprobs``, ``inference_logprobs``, ``ref_logprobs``, ``advantages``,
``loss_mask`` and ``loss_weights``) and divides the returned sum by the component's global
token count itself. Two callables serve the two ways of calling it:

- :func:`prime_rl_loss` (``fn(inputs, **kwargs) -> LossOutputs``): the target of
  ``[trainer.loss] type = "custom"``; ``.loss`` is the masked, weighted SUM of one sample,
  ``.metrics`` a dict of 0-d tensors. :data:`IMPORT_PATH` names it.
- :func:`loss_fn` (``loss_fn(inputs, *, alpha_sdpo, ...) -> Tensor``): the same sum as a
  bare tensor.

Notation: ``lp`` trainer log-prob, ``lp_inf`` sampler log-prob, ``lp_ref`` reference log-prob,
``log_r = lp - lp_inf``, ``r = exp(log_r)``, ``dp = exp(lp) - exp(lp_inf)``. The loss is

    sum w * (-keep * adv_tau * A * r + kl_tau * m * log_r^2)
    + alpha_sdpo * sum w * (-keep_ref * stopgrad(lp_ref - lp) * r + kl_tau * m * log_r^2)

with the DPPO binary trust region (arXiv 2602.04879) ``keep = m and not ((A > 0 and dp >
dppo_mask_high) or (A <= 0 and dp < -dppo_mask_low))`` and ``keep_ref = m and not (dp <
-dppo_mask_low)``: the first sum is our trainer's ``rl`` component
(:func:`~composer_replication.ops.token_losses.rl_loss`), the second its ``ref_kl``
component (:func:`~composer_replication.ops.token_losses.ref_kl_loss`) on the same tokens.

In PRIME-RL the reference log-probs reach only opd/opsd samples, which train its own
``ref_kl`` loss, so ``alpha_sdpo > 0`` there fails loudly (no reference, or the 0.0 filler
PRIME-RL packs for samples without one) instead of training toward a fake reference; the
term serves callers that pass real reference log-probs with the rl samples.

``beta_dpo`` (trace-replay DPO) cannot run here: PRIME-RL's hook sees one sample's
log-probs, never a chosen/rejected pair nor logits, so ``beta_dpo > 0`` is rejected. Train
that channel with our own trainer (algorithm ``replay_dpo`` or ``composer``).

Nothing here imports PRIME-RL: the inputs are duck-typed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from composer_replication.ops.token_losses import dppo_keep_mask, ref_kl_loss, rl_loss
from composer_replication.ops.trust_region import mismatch_kl, ref_kl_sample_metrics

#: The ``[trainer.loss] import_path`` PRIME-RL resolves (dotted: module path + attribute).
IMPORT_PATH = "composer_replication.recipes.prime_rl.composer_loss.prime_rl_loss"

#: The knobs and their defaults (PRIME-RL's default loss uses the same values).
DEFAULT_KNOBS: dict[str, float] = {
    "alpha_sdpo": 0.0,
    "beta_dpo": 0.0,
    "dppo_mask_high": 0.2,
    "dppo_mask_low": 0.2,
    "adv_tau": 1.0,
    "kl_tau": 1e-3,
}

_TENSOR_FIELDS = ("trainer_logprobs", "inference_logprobs", "advantages", "loss_mask")


@dataclass
class LossOutputs:
    """One sample's loss (a 0-d tensor, a sum) and its metrics (0-d tensors), the shape of
    the result PRIME-RL's trainer reads from a custom loss."""

    loss: Tensor
    metrics: dict[str, Tensor]


def check_knobs(knobs: dict[str, Any]) -> dict[str, float]:
    """The knobs with defaults filled in, or a ValueError naming the bad one and the fix."""
    unknown = sorted(set(knobs) - set(DEFAULT_KNOBS))
    if unknown:
        raise ValueError(
            f"unknown loss knob(s) {unknown}; the composer loss takes {sorted(DEFAULT_KNOBS)} "
            "([trainer.loss] kwargs): remove or rename them"
        )
    out = dict(DEFAULT_KNOBS)
    for name, value in knobs.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name}={value!r} must be a number (e.g. {DEFAULT_KNOBS[name]})")
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"{name}={value} must be a finite number >= 0 (default {DEFAULT_KNOBS[name]})"
            )
        out[name] = float(value)
    if out["beta_dpo"] > 0:
        raise ValueError(
            f"beta_dpo={out['beta_dpo']}: trace-replay DPO needs chosen/rejected pairs with "
            "reference log-probs, and PRIME-RL's per-sample loss hook receives one sample's "
            "log-probs (no pairs, no logits); set beta_dpo = 0 here and train the DPO channel "
            "with composer-replication's own trainer (algorithm 'replay_dpo' or 'composer')"
        )
    return out


def _sample_tensors(inputs: Any, need_ref: bool) -> dict[str, Tensor | None]:
    """The sample's tensors, checked: 1-D, one length, floating log-probs."""
    found: dict[str, Tensor | None] = {}
    for name in _TENSOR_FIELDS:
        value = getattr(inputs, name, None)
        if not isinstance(value, Tensor):
            raise ValueError(
                f"inputs.{name} is {type(value).__name__}, not a tensor: pass an object with "
                f"1-D tensors {', '.join(_TENSOR_FIELDS)} (PRIME-RL's LossInputs)"
            )
        found[name] = value
    # Our name for the reference log-probs is teacher_logprobs; PRIME-RL's is ref_logprobs.
    teacher = getattr(inputs, "teacher_logprobs", None)
    ref = getattr(inputs, "ref_logprobs", None)
    if teacher is not None and ref is not None and teacher is not ref:
        raise ValueError(
            "inputs carry both teacher_logprobs and ref_logprobs: they name the same "
            "reference log-probs, give one of them"
        )
    found["ref_logprobs"] = teacher if teacher is not None else ref
    found["loss_weights"] = getattr(inputs, "loss_weights", None)
    for name, value in found.items():
        if value is not None and value.dim() != 1:
            raise ValueError(
                f"inputs.{name} has shape {tuple(value.shape)}; the loss takes one sample at a "
                "time as 1-D (seq,) tensors: call it per sample (flatten or unpack the batch)"
            )
    lengths = {name: value.shape[0] for name, value in found.items() if value is not None}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"inputs have different lengths {lengths}: give one length per sample")
    for name in ("trainer_logprobs", "inference_logprobs", "ref_logprobs"):
        value = found[name]
        if value is not None and not value.is_floating_point():
            raise ValueError(f"inputs.{name} has dtype {value.dtype}; log-probs must be floating")
    if need_ref and found["ref_logprobs"] is None:
        raise ValueError(
            "alpha_sdpo > 0 needs reference log-probs (inputs.ref_logprobs or "
            "inputs.teacher_logprobs): in PRIME-RL they ship with opd/opsd samples only; set "
            "alpha_sdpo = 0 or train an environment whose algorithm scores a reference"
        )
    if need_ref:
        tokens = found["loss_mask"] != 0
        ref = found["ref_logprobs"]
        # PRIME-RL packs samples without reference log-probs next to ones with them by
        # filling 0.0 (probability 1): a reverse KL against that filler would train silently
        # toward a fake reference.
        if bool(tokens.any()) and bool((ref[tokens] == 0).all()):
            raise ValueError(
                "alpha_sdpo > 0 but every reference log-prob on this sample's loss tokens is "
                "0.0: that is PRIME-RL's filler for a sample that has no reference log-probs "
                "(in PRIME-RL they reach opd/opsd samples, which train its own ref_kl loss); "
                "set alpha_sdpo = 0 there and give the environment algorithm opd or opsd"
            )
    return found


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over ``mask`` (0 when the mask is empty), as a 0-d tensor."""
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp_min(1.0)


def _rl_metrics(lp: Tensor, lp_inf: Tensor, adv: Tensor, mask: Tensor, knobs: dict) -> dict:
    """Trust-region diagnostics under PRIME-RL's default-loss names (no grad)."""
    with torch.no_grad():
        lp = lp.detach()
        tokens = mask != 0
        kept = dppo_keep_mask(
            lp,
            lp_inf,
            adv,
            mask,
            mask_low=knobs["dppo_mask_low"],
            mask_high=knobs["dppo_mask_high"],
        )
        dropped = tokens & ~kept
        dp = lp.exp() - lp_inf.exp()
        high = (adv > 0) & (dp > knobs["dppo_mask_high"])
        # the keep mask's own sides (A <= 0 counts as low), so high + low = is_masked
        low = (adv <= 0) & (dp < -knobs["dppo_mask_low"])
        mkl = mismatch_kl(lp, lp_inf)
        dtype = lp.dtype
        return {
            "is_masked": _masked_mean(dropped.to(dtype), tokens),
            "is_masked_high": _masked_mean(high.to(dtype), tokens),
            "is_masked_low": _masked_mean(low.to(dtype), tokens),
            "masked_mismatch_kl": _masked_mean(mkl, dropped),
            "unmasked_mismatch_kl": _masked_mean(mkl, kept),
        }


def _loss_and_metrics(inputs: Any, knobs: dict[str, float]) -> LossOutputs:
    alpha = knobs["alpha_sdpo"]
    t = _sample_tensors(inputs, need_ref=alpha > 0)
    lp, lp_inf, adv, mask = (t[name] for name in _TENSOR_FIELDS)
    weights, ref = t["loss_weights"], t["ref_logprobs"]
    adv = adv.to(lp.dtype)
    total, _ = rl_loss(
        lp,
        lp_inf,
        adv,
        mask,
        weights,
        mask_low=knobs["dppo_mask_low"],
        mask_high=knobs["dppo_mask_high"],
        adv_tau=knobs["adv_tau"],
        kl_tau=knobs["kl_tau"],
    )
    metrics = _rl_metrics(lp, lp_inf, adv, mask, knobs)
    if alpha > 0:
        ref = ref.to(lp.dtype)
        ref_sum, _ = ref_kl_loss(
            lp, lp_inf, ref, mask, weights, mask_low=knobs["dppo_mask_low"], kl_tau=knobs["kl_tau"]
        )
        total = total + alpha * ref_sum
        per_sample = ref_kl_sample_metrics(
            lp, lp_inf, ref, mask, weights, mask_low=knobs["dppo_mask_low"]
        )
        for name, values in per_sample.items():
            # A sample without reference tokens reports 0 (PRIME-RL averages over samples).
            metrics[name] = values[0] if values.numel() else lp.new_zeros(())
    return LossOutputs(loss=total, metrics=metrics)


def prime_rl_loss(inputs: Any, **kwargs: Any) -> LossOutputs:
    """PRIME-RL's custom-loss form: ``fn(inputs, **kwargs) -> LossOutputs``.

    ``kwargs`` are the ``[trainer.loss] kwargs`` (:data:`DEFAULT_KNOBS`). ``.loss`` is the
    sum over the sample's ``loss_mask`` tokens, each multiplied by ``inputs.loss_weights``
    when given (PRIME-RL divides by the component's global token count); ``.metrics`` holds
    ``is_masked``, ``is_masked_high``, ``is_masked_low``, ``masked_mismatch_kl``,
    ``unmasked_mismatch_kl`` and, with ``alpha_sdpo > 0``, the ``ref_kl`` diagnostics.
    """
    return _loss_and_metrics(inputs, check_knobs(kwargs))


def loss_fn(
    inputs: Any,
    *,
    alpha_sdpo: float = 0.0,
    beta_dpo: float = 0.0,
    dppo_mask_high: float = 0.2,
    dppo_mask_low: float = 0.2,
    adv_tau: float = 1.0,
    kl_tau: float = 1e-3,
) -> Tensor:
    """The same per-sample sum as :func:`prime_rl_loss`, returned as a 0-d tensor.

    ``inputs`` has 1-D ``trainer_logprobs``, ``inference_logprobs``, ``advantages`` and
    ``loss_mask``, optionally ``teacher_logprobs`` (or ``ref_logprobs``) and
    ``loss_weights``. ``alpha_sdpo`` weighs the reverse KL to the reference (our ``ref_kl``
    component, needs reference log-probs); ``beta_dpo`` must be 0: trace-replay DPO needs
    preference pairs, which a per-sample hook never receives.
    """
    knobs = check_knobs(
        {
            "alpha_sdpo": alpha_sdpo,
            "beta_dpo": beta_dpo,
            "dppo_mask_high": dppo_mask_high,
            "dppo_mask_low": dppo_mask_low,
            "adv_tau": adv_tau,
            "kl_tau": kl_tau,
        }
    )
    return _loss_and_metrics(inputs, knobs).loss
