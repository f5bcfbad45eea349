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

from composer_replication.config.loss import COMPONENTS, LossConfig
from composer_replication.model_parts import last_hidden_states, lm_head_weight
from composer_replication.ops.divergence import (
    DIVERGENCE_KNOBS,
    DivergenceSettings,
    divergence_settings,
)
from composer_replication.ops.head import IGNORE_INDEX, token_logprobs_from_hidden
from composer_replication.ops.pairs import (
    PAIR_KNOBS,
    PairLossSettings,
    pair_loss_settings,
    pair_terms,
)
from composer_replication.ops.self_distillation import aligned_from_index, divergence_terms
from composer_replication.ops.trust_region import (
    ref_kl_metrics_from_sums,
    ref_kl_sample_metrics,
    ref_kl_step_sums,
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

__all__ = [
    "COMPONENTS",
    "LossConfig",
    "component_counts",
    "divergence_settings_of",
    "pair_settings_of",
    "train_step",
]


def divergence_settings_of(cfg: LossConfig) -> DivergenceSettings:
    """The jsd component's divergence as ``cfg`` sets it (``taid_t`` must be resolved)."""
    knobs = {k: getattr(cfg, k) for k in DIVERGENCE_KNOBS}
    return divergence_settings(**knobs, chunk_size=cfg.chunk_size)


def pair_settings_of(cfg: LossConfig) -> PairLossSettings:
    """The dpo component's pair loss as ``cfg`` sets it."""
    return pair_loss_settings(**{k: getattr(cfg, k) for k in PAIR_KNOBS})


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
    metric_reducer: Callable[[dict[str, float]], dict[str, float]] | None = None,
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
        metric_reducer: sums the sums behind the returned metrics over data-parallel ranks
            (so every rank reports the whole batch's metrics, as one process would).

    Returns:
        Metrics: ``loss`` (the total), ``loss/<component>`` (its mean), ``tokens/<c>``,
        ``rl/masked_fraction`` (share of live rl tokens outside the trust region),
        ``kl/inference`` (token-mean k3 estimate of KL(sampler || trainer) on live rl
        tokens), ``entropy`` (token-mean over trainable tokens), ``tokens/total``; when a
        sample has ``ref_kl`` tokens, its trust-region metrics as PRIME-RL logs them
        (means over those samples): ``ref_kl/mean`` (of ``lp_ref - lp``),
        ``ref_kl/is_masked/mean``, ``ref_kl/masked_mismatch_kl/mean``,
        ``ref_kl/unmasked_mismatch_kl/mean`` (see :mod:`composer_replication.ops.trust_region`).
    """
    cfg = config or LossConfig()
    counts = component_counts(batches)  # on the host micro-batches: no device sync
    if count_reducer is not None:
        counts = count_reducer(counts)
    sums = dict.fromkeys(COMPONENTS, 0.0)
    stats = {"masked": 0.0, "live": 0.0, "kl": 0.0, "entropy": 0.0, "trainable": 0.0, "tokens": 0.0}
    ref_kl_rows: list[dict[str, Tensor]] = []
    total = 0.0
    device = lm_head_weight(policy).device
    for mb in batches:
        if mb.n_rows == 0 and not mb.pairs:
            continue
        mb = mb.to(device)  # packed on the host; the step runs where the policy lives
        parts = _micro_batch_losses(policy, mb, cfg, teacher, reference, stats, ref_kl_rows)
        loss = parts.pop("_anchor")
        for name, value in parts.items():
            if counts[name] == 0:
                continue
            sums[name] += float(value.detach())
            loss = loss + cfg.coefficient(name) * value / counts[name]
        loss.backward()
        total += float(loss.detach())
    parts = {
        "loss": total,
        **{f"sum/{name}": value for name, value in sums.items()},
        **{f"stat/{name}": value for name, value in stats.items()},
        **ref_kl_step_sums(ref_kl_rows),
    }
    if metric_reducer is not None:
        parts = metric_reducer(parts)
    return _step_metrics(parts, counts)


def _step_metrics(parts: dict[str, float], counts: dict[str, int]) -> dict[str, float]:
    """The step's metrics from its sums (see :func:`train_step`)."""
    stat = {name[len("stat/") :]: v for name, v in parts.items() if name.startswith("stat/")}
    metrics: dict[str, float] = {"loss": parts["loss"]}
    for name in COMPONENTS:
        total = parts[f"sum/{name}"]
        metrics[f"loss/{name}"] = total / counts[name] if counts[name] else 0.0
        metrics[f"tokens/{name}"] = float(counts[name])
    metrics["rl/masked_fraction"] = stat["masked"] / stat["live"] if stat["live"] else 0.0
    metrics["kl/inference"] = stat["kl"] / stat["live"] if stat["live"] else 0.0
    metrics["entropy"] = stat["entropy"] / stat["trainable"] if stat["trainable"] else 0.0
    metrics["tokens/total"] = stat["tokens"]
    metrics.update(ref_kl_metrics_from_sums(parts))
    return metrics


def _micro_batch_losses(
    policy: Any,
    mb: MicroBatch,
    cfg: LossConfig,
    teacher: Any | None,
    reference: Any | None,
    stats: dict[str, float],
    ref_kl_rows: list[dict[str, Tensor]],
) -> dict[str, Tensor]:
    """Component sums of one micro-batch (unnormalised) plus a zero ``_anchor`` with grad."""
    parts: dict[str, Tensor] = {}
    anchor = None
    if mb.n_rows:
        hidden = last_hidden_states(policy, mb.input_ids, mb.attention_mask)
        # read after the forward: a sharded (FSDP2) policy gathers the weight in it
        weight = lm_head_weight(policy)
        logprobs, entropy = token_logprobs_from_hidden(
            hidden[:, :-1],
            weight,
            _weighted_targets(mb),
            temperature=cfg.log_temperature,
            chunk_size=cfg.chunk_size,
            return_entropy=True,
        )
        # An exact zero on the graph: every micro-batch backpropagates, even an empty one.
        anchor = 0.0 * logprobs.sum()
        _add_token_components(parts, mb, cfg, logprobs, entropy, stats, ref_kl_rows)
        if mb.jsd_weights is not None and bool((mb.jsd_weights != 0).any()):
            parts["jsd"] = _jsd_sum(policy if teacher is None else teacher, hidden, weight, mb, cfg)
    if mb.pairs:
        parts["dpo"] = _dpo_sum(policy, reference, mb.pairs, cfg)
        if anchor is None:
            anchor = 0.0 * parts["dpo"]
    parts["_anchor"] = anchor
    return parts


def _weighted_targets(mb: MicroBatch) -> Tensor:
    """Next-token targets, ``IGNORE_INDEX`` where no token stream has a weight (prompts,
    padding): the head then skips those positions (their log-prob reads 0)."""
    needed = mb.loss_mask[:, 1:] != 0
    if mb.ce_weights is not None:
        needed = needed | (mb.ce_weights[:, 1:] != 0)
    return mb.input_ids[:, 1:].masked_fill(~needed, IGNORE_INDEX)


def _add_token_components(
    parts: dict[str, Tensor],
    mb: MicroBatch,
    cfg: LossConfig,
    logprobs: Tensor,
    entropy: Tensor,
    stats: dict[str, float],
    ref_kl_rows: list[dict[str, Tensor]],
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
        ref_kl_rows.append(
            ref_kl_sample_metrics(logprobs, inf, ref, mask, ref_w, mask_low=cfg.mask_low)
        )


def _jsd_sum(
    teacher: Any, hidden: Tensor, weight: Tensor, mb: MicroBatch, cfg: LossConfig
) -> Tensor:
    tokens = aligned_from_index(mb.jsd_weights, mb.teacher_index)
    per_token = divergence_terms(
        hidden,
        weight,
        teacher,
        mb.teacher_input_ids,
        mb.teacher_attention_mask,
        tokens,
        divergence_settings_of(cfg),
    )
    value, _ = weighted_token_loss(per_token, mb.jsd_weights[tokens.rows, tokens.student])
    return value


def _dpo_sum(
    policy: Any, reference: Any | None, pairs: list[DPOPairTokens], cfg: LossConfig
) -> Tensor:
    per_pair = pair_terms(
        policy, pairs, pair_settings_of(cfg), reference=reference, chunk_size=cfg.chunk_size
    )
    weights = torch.tensor([p.weight for p in pairs], dtype=per_pair.dtype, device=per_pair.device)
    return (weights * per_pair).sum()
