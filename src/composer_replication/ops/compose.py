"""The three-channel Composer loss on one batch, through the one loss assembler.

``compose_loss`` converts its padded batch into training samples
(:mod:`composer_replication.ops.padded`) and runs
:func:`composer_replication.ops.assembler.micro_batch_losses`, the call the native trainer
step and the trl trainer make: the channels are its ``ce``, ``jsd`` and ``dpo`` components,
each divided by its own token (pair) count.

``total = lm_ce + alpha_sdpo * sdpo_jsd + beta_replay * trace_replay_dpo``

1. ``lm_ce``: next-token cross-entropy on the response tokens (optional label smoothing).
2. ``sdpo_jsd``: self-distillation (SDPO, arXiv 2601.20802): the token-mean divergence
   between the policy on the plain context (student, with grad) and the policy on the
   hint-augmented context (teacher, no grad) at the aligned response positions. The
   divergence is the generalized JSD (GKD, arXiv 2306.13649) or, with ``sdpo_wrapper``,
   TAID (arXiv 2501.16937) or entropy-aware OPD (arXiv 2603.07079).
3. ``trace_replay_dpo``: the mean pair loss on (chosen, rejected) sequences from
   teacher-consensus replay of agent traces: DPO (arXiv 2305.18290) against reference
   log-probs, or SimPO (arXiv 2405.14734), reference-free.

The input dict is documented in :mod:`composer_replication.ops.compose_batch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from composer_replication.config.loss import LossConfig, loss_default
from composer_replication.model.parts import AdapterDisabled
from composer_replication.ops.assembler import pair_settings_of
from composer_replication.ops.divergence import (
    DIVERGENCE_KNOBS,
    SDPO_WRAPPERS,
    divergence_settings,
)
from composer_replication.ops.padded import padded_losses, padded_samples
from composer_replication.ops.pairs import (
    PAIR_KNOBS,
    fill_reference_logps,
    pair_loss_settings,
    pairs_from_padded,
    sequence_logps,
)
from composer_replication.ops.pairs import (
    PAIR_VARIANTS as DPO_VARIANTS,
)
from composer_replication.ops.self_distillation import aligned_from_masks

if TYPE_CHECKING:
    from collections.abc import Mapping

    from torch import Tensor

__all__ = [
    "DPO_VARIANTS",
    "SDPO_WRAPPERS",
    "LossComponents",
    "compose_loss",
    "divergence_settings",
    "pair_loss_settings",
    "sdpo_tokens",
    "sequence_logps",
]


_SDPO_KEYS = ("ctx_teacher_input_ids", "sdpo_loss_mask")
_DPO_KEYS = (
    "dpo_chosen_input_ids",
    "dpo_chosen_response_mask",
    "dpo_rejected_input_ids",
    "dpo_rejected_response_mask",
)
# Reference log-prob keys ((P,) sums or (P, T) per-token values): the current names, then
# an older spelling that is still read.
_REF_KEYS = (
    ("dpo_chosen_ref_logprobs", "dpo_rejected_ref_logprobs"),
    ("dpo_ref_chosen_logps", "dpo_ref_rejected_logps"),
)


@dataclass
class LossComponents:
    """Scalar loss tensors of the three channels and their weighted total."""

    lm_ce: Tensor
    sdpo_jsd: Tensor
    trace_replay_dpo: Tensor
    total: Tensor

    def detached(self) -> dict[str, float]:
        """The four values as Python floats (no grad), for logging."""
        return {
            "lm_ce": float(self.lm_ce.detach()),
            "sdpo_jsd": float(self.sdpo_jsd.detach()),
            "trace_replay_dpo": float(self.trace_replay_dpo.detach()),
            "total": float(self.total.detach()),
        }


def compose_loss(
    model: Any,
    inputs: Mapping[str, Tensor],
    *,
    alpha_sdpo: float = loss_default("alpha_sdpo"),
    beta_replay: float = loss_default("beta_replay"),
    sdpo_jsd_beta: float = loss_default("sdpo_jsd_beta"),
    sdpo_temperature: float = loss_default("sdpo_temperature"),
    sdpo_token_clip: float | None = loss_default("sdpo_token_clip"),
    replay_dpo_beta: float = loss_default("replay_dpo_beta"),
    lm_ce_label_smoothing: float = loss_default("lm_ce_label_smoothing"),
    dpo_variant: str = loss_default("dpo_variant"),
    sdpo_wrapper: str = loss_default("sdpo_wrapper"),
    taid_t: Any = None,
    simpo_beta: float = loss_default("simpo_beta"),
    simpo_gamma: float = loss_default("simpo_gamma"),
    entropy_opd_h_max: float | None = loss_default("entropy_opd_h_max"),
    ref_model: Any | None = None,
    teacher_model: Any | None = None,
    chunk_size: int | None = loss_default("chunk_size"),
    loss_config: LossConfig | None = None,
) -> LossComponents:
    """Compute the three Composer channels on one batch.

    Args:
        model: the policy, a Hugging Face causal LM (PEFT-wrapped or not).
        inputs: the dict of :func:`composer_replication.batch.build_batch` (or
            ``ComposerDataCollator``). A channel whose keys are absent, or whose weight is
            0, contributes an exact 0 (a tensor that requires grad) and is not computed.
        alpha_sdpo: weight of the SDPO channel (>= 0; 0 turns it off: no teacher forward).
        beta_replay: weight of the trace-replay channel (>= 0; 0 turns it off: no pair
            forward, no reference log-probs needed).
        sdpo_jsd_beta: the JSD's mixture coefficient (0 forward KL, 1 reverse KL).
        sdpo_temperature: both distributions' softmax temperature.
        sdpo_token_clip: clamp each token's divergence to this value (None: no clamp).
        replay_dpo_beta: DPO's beta.
        lm_ce_label_smoothing: label smoothing of channel 1, in [0, 1).
        dpo_variant: ``"dpo"`` (reference log-probs used) or ``"simpo"`` (length-normalised,
            reference-free, ``simpo_beta`` / ``simpo_gamma``).
        sdpo_wrapper: ``"none"`` (generalized JSD), ``"taid"`` (TAID at ``taid_t``, a number
            or a ``TAIDScheduler``) or ``"entropy_opd"`` (entropy-aware OPD with
            ``entropy_opd_h_max``, default log V). The ``sdpo_loss_mask`` selects the tokens
            in every case.
        ref_model: frozen initial model for the DPO reference log-probs, used when the
            batch does not carry them (``dpo_chosen_ref_logprobs`` /
            ``dpo_rejected_ref_logprobs``: (P,) sums or (P, T) per-token values). They are
            computed once and written into ``inputs`` as (P,) sums (when it is a mutable
            dict), so a re-used batch never pays for them twice. With neither, a LoRA
            policy's adapters are disabled to recover the initial model; otherwise
            ``ValueError``.
        teacher_model: model for the SDPO teacher forward (default: ``model`` itself, under
            ``no_grad``: the live policy teaches itself through the hint).
        chunk_size: rows per chunk on the hidden-state path.
        loss_config: the loss settings as one :class:`LossConfig` (a run's ``[loss]``
            table) instead of the knob arguments above, which must then keep their
            defaults (``taid_t`` may still be a ``TAIDScheduler``).

    Returns:
        :class:`LossComponents`.
    """
    for name, value in (("alpha_sdpo", alpha_sdpo), ("beta_replay", beta_replay)):
        if value < 0:
            raise ValueError(f"{name}={value} must be >= 0")
    # the knobs a LossConfig holds (taid_t may be a scheduler, which a config cannot)
    knobs = {
        "lm_ce_label_smoothing": lm_ce_label_smoothing,
        "chunk_size": chunk_size,
        "dpo_variant": dpo_variant,
        "replay_dpo_beta": replay_dpo_beta,
        "simpo_beta": simpo_beta,
        "simpo_gamma": simpo_gamma,
        "sdpo_jsd_beta": sdpo_jsd_beta,
        "sdpo_temperature": sdpo_temperature,
        "sdpo_token_clip": sdpo_token_clip,
        "sdpo_wrapper": sdpo_wrapper,
        "entropy_opd_h_max": entropy_opd_h_max,
    }
    if loss_config is not None:
        knobs = _knobs_of(loss_config, knobs)
        if taid_t is None:
            taid_t = loss_config.taid_t
    chunk_size = knobs["chunk_size"]
    cfg = LossConfig.from_knobs(
        **{k: knobs[k] for k in ("lm_ce_label_smoothing", "chunk_size", *PAIR_KNOBS)}
    )
    divergence = divergence_settings(
        **{k: knobs[k] for k in DIVERGENCE_KNOBS if k != "taid_t"},
        taid_t=taid_t,
        chunk_size=chunk_size,
    )
    if "input_ids" not in inputs or "response_mask" not in inputs:
        raise ValueError(
            "inputs needs 'input_ids' and 'response_mask' (build it with "
            "composer_replication.batch.build_batch)"
        )
    input_ids = inputs["input_ids"]
    response_mask = inputs["response_mask"]
    _check_same_shape("response_mask", response_mask, input_ids)

    teacher = None
    tokens = None
    if alpha_sdpo > 0 and all(k in inputs for k in _SDPO_KEYS):
        tokens = sdpo_tokens(inputs)
        teacher = (inputs["ctx_teacher_input_ids"], inputs.get("ctx_teacher_attention_mask"))
    samples = padded_samples(
        input_ids,
        inputs.get("attention_mask"),
        ce_mask=response_mask,
        teacher_ids=None if teacher is None else teacher[0],
        teacher_attention_mask=None if teacher is None else teacher[1],
        tokens=tokens,
    )
    pairs = []
    if beta_replay > 0 and all(k in inputs for k in _DPO_KEYS):
        pairs = _batch_pairs(inputs)
        if pair_settings_of(cfg).needs_reference and pairs[0].ref_chosen_logp is None:
            fill_reference_logps(_reference(model, ref_model), pairs, chunk_size=chunk_size)
            if isinstance(inputs, dict):  # cache: a re-used batch never pays for them twice
                device = input_ids.device
                for key, side in zip(_REF_KEYS[0], ("chosen", "rejected")):
                    values = [getattr(p, f"ref_{side}_logp") for p in pairs]
                    inputs[key] = torch.tensor(values, dtype=torch.float32, device=device)
    losses = padded_losses(
        model,
        samples,
        pairs,
        cfg,
        divergence=divergence,
        teacher=teacher_model,
    )
    zero = _graph_zero(input_ids)
    lm_ce = losses.mean("ce", zero)
    sdpo = losses.mean("jsd", zero)
    replay = losses.mean("dpo", zero)
    total = lm_ce + alpha_sdpo * sdpo + beta_replay * replay
    return LossComponents(lm_ce=lm_ce, sdpo_jsd=sdpo, trace_replay_dpo=replay, total=total)


def _knobs_of(config: LossConfig, given: dict[str, Any]) -> dict[str, Any]:
    """``compose_loss``'s knobs read from ``config``; a knob also given as an argument (not
    at its default) is a one-line ``ValueError``: one setting, one place."""
    for name, value in given.items():
        if value != loss_default(name):
            raise ValueError(
                f"compose_loss: {name}={value!r} given beside loss_config; set "
                f"loss_config.{name} instead"
            )
    return {name: getattr(config, name) for name in given}


def sdpo_tokens(inputs: Mapping[str, Tensor]) -> Any:
    """The distilled tokens of a ``compose_loss`` batch, in both contexts.

    ``sdpo_loss_mask`` marks the distilled response tokens either in the student context
    (our collator's layout, (B, T)) or in the teacher context (``build_batch``'s layout,
    (B, T')). When both contexts have one shape, the mask is read on the side whose response
    tokens contain it (with ``align_sdpo_shapes=True`` both do, and agree). Without
    ``ctx_teacher_response_mask`` the response is the last tokens of each attended teacher
    row.
    """
    input_ids, response_mask = inputs["input_ids"], inputs["response_mask"]
    t_ids = inputs["ctx_teacher_input_ids"]
    t_attn = inputs.get("ctx_teacher_attention_mask")
    if t_attn is None:
        t_attn = torch.ones_like(t_ids)
    t_resp = inputs.get("ctx_teacher_response_mask")
    if t_resp is None:
        t_resp = _right_aligned_response_mask(t_attn, response_mask)
    _check_same_shape("ctx_teacher_response_mask", t_resp, t_ids)
    mask = inputs["sdpo_loss_mask"]
    on_student = mask.shape == input_ids.shape and _within(mask, response_mask)
    on_teacher = mask.shape == t_ids.shape and _within(mask, t_resp)
    if on_student:
        student_mask = mask
    elif on_teacher:
        student_mask = _teacher_mask_to_student(mask, t_resp, response_mask)
    else:
        raise ValueError(
            f"sdpo_loss_mask {tuple(mask.shape)} must mark response tokens of the student "
            f"context {tuple(input_ids.shape)} or of the teacher context {tuple(t_ids.shape)}"
        )
    return aligned_from_masks(input_ids, response_mask, t_ids, t_resp, student_mask)


def _within(mask: Tensor, response_mask: Tensor) -> bool:
    return not bool(((mask != 0) & (response_mask == 0)).any())


def _teacher_mask_to_student(mask: Tensor, t_resp: Tensor, response_mask: Tensor) -> Tensor:
    # Response token k of the teacher row is response token k of the student row.
    out = torch.zeros_like(response_mask)
    for b in range(mask.shape[0]):
        t_pos = t_resp[b].nonzero().squeeze(-1)
        s_pos = response_mask[b].nonzero().squeeze(-1)
        if t_pos.numel() == s_pos.numel():
            out[b, s_pos] = (mask[b, t_pos] != 0).to(out.dtype)
    return out


def _right_aligned_response_mask(t_attn: Tensor, response_mask: Tensor) -> Tensor:
    # Without an explicit mask, the response is the last n attended tokens of each row.
    out = torch.zeros_like(t_attn)
    lengths = t_attn.sum(-1)
    counts = (response_mask != 0).sum(-1)
    for b in range(t_attn.shape[0]):
        end = int(lengths[b])
        out[b, end - int(counts[b]) : end] = 1
    return out


def _batch_pairs(inputs: Mapping[str, Tensor]) -> list[Any]:
    refs = next(
        ((inputs[c], inputs[r]) for c, r in _REF_KEYS if c in inputs and r in inputs), (None, None)
    )
    return pairs_from_padded(
        tuple(
            inputs.get(f"dpo_chosen_{k}") for k in ("input_ids", "response_mask", "attention_mask")
        ),
        tuple(
            inputs.get(f"dpo_rejected_{k}")
            for k in ("input_ids", "response_mask", "attention_mask")
        ),
        ref_chosen=refs[0],
        ref_rejected=refs[1],
    )


def _reference(model: Any, ref_model: Any | None) -> Any:
    if ref_model is not None:
        return ref_model
    if AdapterDisabled.applies_to(model):  # LoRA: the base weights are the initial model
        return AdapterDisabled(model)
    raise ValueError(
        "trace-replay DPO needs reference log-probs: put 'dpo_chosen_ref_logprobs' and "
        "'dpo_rejected_ref_logprobs' in the batch (build_batch(..., ref_model=...)), or pass "
        "ref_model= (a frozen copy of the initial policy), or use dpo_variant='simpo' "
        "(reference-free)"
    )


def _graph_zero(like: Tensor) -> Tensor:
    # An exact 0 that carries grad, so `total.backward()` behaves the same whether or not
    # the channel's inputs were present.
    return torch.zeros((), dtype=torch.float32, device=like.device, requires_grad=True)


def _check_same_shape(name: str, tensor: Tensor, ref: Tensor) -> None:
    if tensor.shape != ref.shape:
        raise ValueError(f"{name} {tuple(tensor.shape)} must match {tuple(ref.shape)}")
