"""The algorithm-blind trainer step: execute the loss components over packed micro-batches.

For each component c the step computes ``sum_c`` over its weight stream and divides by
``N_c``, the count of tokens (pairs, for dpo) with a non-zero weight in that component
across ALL micro-batches of the step (optionally all-reduced over data-parallel ranks), so
gradient accumulation gives the same gradient as one big batch and components never dilute
each other. ``total = sum_c coef_c * sum_c / N_c``; backward runs once per micro-batch.

Log-probs, entropies and the JSD come from the chunked hidden-state path
(:mod:`composer_replication.chunked_head`): full (B, T, V) logits are never materialised.
The ``jsd`` component runs the teacher forward (hint/demo context, no grad) inside the step
on a model handed in by :class:`~composer_replication.trainer.teachers.TeacherModels`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from composer_replication.chunked_head import (
    jsd_from_hidden,
    last_hidden_states,
    lm_head_weight,
    token_logprobs_from_hidden,
)
from composer_replication.trainer.components import (
    ce_loss,
    dppo_keep_mask,
    k2_trust_mask,
    ref_kl_loss,
    rl_loss,
    weighted_token_loss,
)

if TYPE_CHECKING:
    from torch import Tensor

    from composer_replication.wire import DPOPairTokens, MicroBatch

COMPONENTS = ("rl", "ce", "ref_kl", "jsd", "dpo")


class LossConfig(BaseModel):
    """Settings of the loss components (02-algorithms.md §1)."""

    model_config = ConfigDict(extra="forbid")

    mask_low: float = Field(
        0.2, ge=0, description="DPPO trust region below: drop A<=0 tokens with dp < -mask_low."
    )
    mask_high: float = Field(
        0.2, ge=0, description="DPPO trust region above: drop A>0 tokens with dp > mask_high."
    )
    adv_tau: float = Field(1.0, ge=0, description="Scale of the advantage term of rl.")
    kl_tau: float = Field(1e-3, ge=0, description="Weight of the log-ratio^2 penalty (rl, ref_kl).")
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature; trainer log-probs use logits / temperature."
    )
    jsd_beta: float = Field(
        0.5, ge=0, le=1, description="Generalized JSD mixture (0 forward KL, 1 reverse KL)."
    )
    jsd_temperature: float = Field(
        1.0, gt=0, description="Softmax temperature of both jsd distributions."
    )
    dpo_beta: float = Field(0.1, gt=0, description="DPO beta.")
    dpo_loss: str = Field(
        "dpo", pattern="^(dpo|simpo)$", description="Pair loss: 'dpo' or 'simpo'."
    )
    simpo_gamma: float = Field(1.0, ge=0, description="SimPO margin (dpo_loss='simpo').")
    coefficients: dict[str, float] = Field(
        default_factory=lambda: dict.fromkeys(COMPONENTS, 1.0),
        description="Multiplier of each component's mean (rl, ce, ref_kl, jsd, dpo).",
    )
    kl_token_trust_threshold: float | None = Field(
        None,
        ge=0,
        description="Mask ref_kl tokens whose k2 estimate to the reference exceeds this.",
    )
    chunk_size: int | None = Field(
        None, ge=1, description="Rows per chunk on the hidden-state path."
    )

    def coefficient(self, component: str) -> float:
        unknown = set(self.coefficients) - set(COMPONENTS)
        if unknown:
            raise ValueError(f"unknown loss components {sorted(unknown)}; known: {COMPONENTS}")
        return float(self.coefficients.get(component, 1.0))


def component_counts(batches: Sequence[MicroBatch]) -> dict[str, int]:
    """Per-component count of tokens (pairs) with a non-zero weight over all micro-batches."""
    counts = dict.fromkeys(COMPONENTS, 0)
    for mb in batches:
        mask = mb.loss_mask[:, 1:] != 0
        counts["rl"] += int((mask & (mb.rl_weights[:, 1:] != 0)).sum())
        if mb.ce_weights is not None:
            counts["ce"] += int((mb.ce_weights[:, 1:] != 0).sum())
        if mb.ref_kl_weights is not None:
            counts["ref_kl"] += int((mask & (mb.ref_kl_weights[:, 1:] != 0)).sum())
        if mb.jsd_weights is not None:
            counts["jsd"] += int((mb.jsd_weights[:, 1:] != 0).sum())
        counts["dpo"] += sum(1 for p in mb.pairs if p.weight != 0)
    return counts


def train_step(
    policy: Any,
    batches: Sequence[MicroBatch],
    config: LossConfig | None = None,
    *,
    teacher: Any | None = None,
    reference: Any | None = None,
    count_reducer: Callable[[dict[str, int]], dict[str, int]] | None = None,
) -> dict[str, float]:
    """Forward + backward over ``batches``, accumulating gradients into ``policy``.

    The caller zeroes gradients before and steps the optimizer after (the step never
    touches the optimizer, so it composes with gradient clipping and DiLoCo).

    Args:
        policy: the trainable causal LM.
        batches: micro-batches from :func:`composer_replication.wire.pack_samples`.
        config: component settings (default :class:`LossConfig`).
        teacher: model for the jsd teacher forward (default: ``policy``, under no_grad).
        reference: frozen initial policy, for DPO reference log-probs a pair lacks
            (computed once, cached on the pair).
        count_reducer: sums the per-component counts over data-parallel ranks.

    Returns:
        Metrics: ``loss`` (the total), ``loss/<component>`` (its mean), ``tokens/<c>``,
        ``rl/masked_fraction`` (share of live rl tokens outside the trust region),
        ``kl/inference`` (token-mean k3 estimate of KL(sampler || trainer) on live rl
        tokens), ``entropy`` (token-mean over trainable tokens), ``tokens/total``.
    """
    cfg = config or LossConfig()
    counts = component_counts(batches)
    if count_reducer is not None:
        counts = count_reducer(counts)
    sums = dict.fromkeys(COMPONENTS, 0.0)
    stats = {"masked": 0.0, "live": 0.0, "kl": 0.0, "entropy": 0.0, "trainable": 0.0, "tokens": 0.0}
    total = 0.0
    for mb in batches:
        if mb.n_rows == 0 and not mb.pairs:
            continue
        parts = _micro_batch_losses(policy, mb, cfg, teacher, reference, stats)
        loss = parts.pop("_anchor")
        for name, value in parts.items():
            if counts[name] == 0:
                continue
            sums[name] += float(value.detach())
            loss = loss + cfg.coefficient(name) * value / counts[name]
        loss.backward()
        total += float(loss.detach())
    metrics: dict[str, float] = {"loss": total}
    for name in COMPONENTS:
        metrics[f"loss/{name}"] = sums[name] / counts[name] if counts[name] else 0.0
        metrics[f"tokens/{name}"] = float(counts[name])
    metrics["rl/masked_fraction"] = stats["masked"] / stats["live"] if stats["live"] else 0.0
    metrics["kl/inference"] = stats["kl"] / stats["live"] if stats["live"] else 0.0
    metrics["entropy"] = stats["entropy"] / stats["trainable"] if stats["trainable"] else 0.0
    metrics["tokens/total"] = stats["tokens"]
    return metrics


def _micro_batch_losses(
    policy: Any,
    mb: MicroBatch,
    cfg: LossConfig,
    teacher: Any | None,
    reference: Any | None,
    stats: dict[str, float],
) -> dict[str, Tensor]:
    """Component sums of one micro-batch (unnormalised) plus a zero ``_anchor`` with grad."""
    weight = lm_head_weight(policy)
    parts: dict[str, Tensor] = {}
    anchor = None
    if mb.n_rows:
        hidden = last_hidden_states(policy, mb.input_ids, mb.attention_mask)
        logprobs, entropy = token_logprobs_from_hidden(
            hidden[:, :-1],
            weight,
            mb.input_ids[:, 1:],
            temperature=cfg.temperature,
            chunk_size=cfg.chunk_size,
            return_entropy=True,
        )
        # An exact zero on the graph: every micro-batch backpropagates, even an empty one.
        anchor = 0.0 * logprobs.sum()
        _add_token_components(parts, mb, cfg, logprobs, entropy, stats)
        if mb.jsd_weights is not None and bool((mb.jsd_weights != 0).any()):
            parts["jsd"] = _jsd_sum(policy if teacher is None else teacher, hidden, weight, mb, cfg)
    if mb.pairs:
        parts["dpo"] = _dpo_sum(policy, reference, mb.pairs, cfg)
        if anchor is None:
            anchor = 0.0 * parts["dpo"]
    parts["_anchor"] = anchor
    return parts


def _add_token_components(
    parts: dict[str, Tensor],
    mb: MicroBatch,
    cfg: LossConfig,
    logprobs: Tensor,
    entropy: Tensor,
    stats: dict[str, float],
) -> None:
    # Streams are per token; log-prob t of `logprobs` is token t+1 of input_ids.
    mask = mb.loss_mask[:, 1:]
    inf = mb.inference_logprobs[:, 1:]
    adv = mb.advantages[:, 1:]
    rl_w = mb.rl_weights[:, 1:]
    parts["rl"], _ = rl_loss(
        logprobs,
        inf,
        adv,
        mask,
        rl_w,
        mask_low=cfg.mask_low,
        mask_high=cfg.mask_high,
        adv_tau=cfg.adv_tau,
        kl_tau=cfg.kl_tau,
    )
    with torch.no_grad():
        live = (mask != 0) & (rl_w != 0)
        keep = dppo_keep_mask(
            logprobs, inf, adv, mask, mask_low=cfg.mask_low, mask_high=cfg.mask_high
        )
        log_r = logprobs - inf
        stats["live"] += float(live.sum())
        stats["masked"] += float((live & ~keep).sum())
        stats["kl"] += float(((log_r.exp() - 1 - log_r) * live).sum())
        stats["entropy"] += float((entropy * (mask != 0)).sum())
        stats["trainable"] += float((mask != 0).sum())
        stats["tokens"] += float(mb.attention_mask.sum())
    if mb.ce_weights is not None:
        parts["ce"], _ = ce_loss(logprobs, mb.ce_weights[:, 1:])
    if mb.ref_kl_weights is not None:
        ref = mb.ref_logprobs[:, 1:]
        ref_w = mb.ref_kl_weights[:, 1:]
        if cfg.kl_token_trust_threshold is not None:
            untrusted = k2_trust_mask(logprobs, ref, cfg.kl_token_trust_threshold)
            ref_w = ref_w.masked_fill(untrusted, 0.0)
        parts["ref_kl"], _ = ref_kl_loss(
            logprobs, inf, ref, mask, ref_w, mask_low=cfg.mask_low, kl_tau=cfg.kl_tau
        )


def _jsd_sum(
    teacher: Any, hidden: Tensor, weight: Tensor, mb: MicroBatch, cfg: LossConfig
) -> Tensor:
    rows, positions = (mb.jsd_weights != 0).nonzero(as_tuple=True)
    teacher_positions = mb.teacher_index[rows, positions]
    with torch.no_grad():
        teacher_hidden = last_hidden_states(
            teacher, mb.teacher_input_ids, mb.teacher_attention_mask
        )
        teacher_weight = lm_head_weight(teacher)
    # Hidden state at p-1 predicts token p, in both contexts.
    student_sel = hidden[rows, positions - 1]
    teacher_sel = teacher_hidden[rows, teacher_positions - 1]
    per_token = jsd_from_hidden(
        student_sel,
        weight,
        teacher_sel,
        teacher_weight=teacher_weight,
        beta=cfg.jsd_beta,
        temperature=cfg.jsd_temperature,
        chunk_size=cfg.chunk_size,
    )
    value, _ = weighted_token_loss(per_token, mb.jsd_weights[rows, positions])
    return value


def _pad(seqs: list[list[int]]) -> tuple[Tensor, Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
    return ids, attn


def pair_logps(
    model: Any, pairs: Sequence[DPOPairTokens], *, chunk_size: int | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Summed response log-probs of each pair's chosen and rejected side, plus lengths."""
    from composer_replication.loss import sequence_logps

    out = []
    for side in ("chosen", "rejected"):
        ids, attn = _pad([getattr(p, f"{side}_ids") for p in pairs])
        resp, _ = _pad([getattr(p, f"{side}_mask") for p in pairs])
        out.append(sequence_logps(model, ids, resp, attn, chunk_size=chunk_size))
        out.append(resp[:, 1:].sum(-1).clamp_min(1))
    return out[0], out[2], out[1], out[3]


def fill_reference_logps(
    reference: Any, pairs: Sequence[DPOPairTokens], *, chunk_size: int | None = None
) -> None:
    """Compute and cache reference log-probs on the pairs that lack them (once per pair)."""
    todo = [p for p in pairs if p.ref_chosen_logp is None or p.ref_rejected_logp is None]
    if not todo:
        return
    with torch.no_grad():
        chosen, rejected, _, _ = pair_logps(reference, todo, chunk_size=chunk_size)
    for pair, c, r in zip(todo, chosen.tolist(), rejected.tolist()):
        pair.ref_chosen_logp, pair.ref_rejected_logp = c, r


def _dpo_sum(
    policy: Any, reference: Any | None, pairs: list[DPOPairTokens], cfg: LossConfig
) -> Tensor:
    from composer_replication.distillation.dpo import dpo_loss
    from composer_replication.distillation.simpo import simpo_loss

    weights = torch.tensor([p.weight for p in pairs], dtype=torch.float32)
    chosen, rejected, n_chosen, n_rejected = pair_logps(policy, pairs, chunk_size=cfg.chunk_size)
    if cfg.dpo_loss == "simpo":  # length-normalised, reference-free (arXiv 2405.14734)
        per_pair = torch.stack(
            [
                simpo_loss((c / nc)[None], (r / nr)[None], beta=cfg.dpo_beta, gamma=cfg.simpo_gamma)
                for c, r, nc, nr in zip(chosen, rejected, n_chosen, n_rejected)
            ]
        )
        return (weights * per_pair).sum()
    if any(p.ref_chosen_logp is None or p.ref_rejected_logp is None for p in pairs):
        if reference is None:
            raise ValueError(
                "a DPO pair has no reference log-probs and no reference model was given: "
                "score the pairs first (Algorithm.score) or pass reference= to train_step"
            )
        fill_reference_logps(reference, pairs, chunk_size=cfg.chunk_size)
    ref_c = torch.tensor([p.ref_chosen_logp for p in pairs], dtype=chosen.dtype)
    ref_r = torch.tensor([p.ref_rejected_logp for p in pairs], dtype=chosen.dtype)
    per_pair = dpo_loss(chosen, rejected, ref_c, ref_r, beta=cfg.dpo_beta, reduction="none")
    return (weights.to(per_pair.dtype) * per_pair).sum()
