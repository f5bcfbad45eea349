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

The step keeps a GPU busy: it never reads device values on the host mid-step (each read
waits for all queued work). Counts, row indices and pair rows come from packing (see
:class:`~composer_replication.wire.MicroBatch`), micro-batches move to the device without
blocking, and every metric stays a device sum until one transfer at the end
(:class:`StepSums`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
    UncachedReferences,
    pair_loss_settings,
    pair_terms,
    reference_logps,
)
from composer_replication.ops.self_distillation import AlignedTokens, divergence_terms
from composer_replication.ops.trust_region import (
    REF_KL_SAMPLE_METRICS,
    ref_kl_metrics_from_sums,
    ref_kl_row_metrics,
    ref_kl_row_sums,
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

    from composer_replication.wire import MicroBatch

__all__ = [
    "COMPONENTS",
    "LossConfig",
    "StepSums",
    "accumulate_step",
    "component_counts",
    "divergence_settings_of",
    "pair_settings_of",
    "step_metrics",
    "train_step",
]

#: The sums behind a step's metrics (besides the per-component ones), in the order read.
_STATS = ("masked", "live", "kl", "entropy", "trainable", "tokens")


def divergence_settings_of(cfg: LossConfig) -> DivergenceSettings:
    """The jsd component's divergence as ``cfg`` sets it (``taid_t`` must be resolved)."""
    knobs = {k: getattr(cfg, k) for k in DIVERGENCE_KNOBS}
    return divergence_settings(**knobs, chunk_size=cfg.chunk_size)


def pair_settings_of(cfg: LossConfig) -> PairLossSettings:
    """The dpo component's pair loss as ``cfg`` sets it."""
    return pair_loss_settings(**{k: getattr(cfg, k) for k in PAIR_KNOBS})


def component_counts(batches: Sequence[MicroBatch]) -> dict[str, int]:
    """Per-component count of tokens (pairs) with a non-zero weight over all micro-batches
    (counted on the host when they were packed)."""
    counts = dict.fromkeys(COMPONENTS, 0)
    for mb in batches:
        for name in COMPONENTS:
            counts[name] += mb.counts[name]
    return counts


@dataclass
class StepSums:
    """A step's metric sums, still on the device, and its per-component counts (host ints).

    ``values`` maps a sum's name to a float64 device scalar (``loss``, ``sum/<component>``,
    ``stat/<name>``, the ``ref_kl`` metric sums); :meth:`read` brings them, with whatever
    else the caller needs (a gradient norm), to the host in ONE transfer, the only time a
    step makes the host wait for the device.
    """

    counts: dict[str, int]
    values: dict[str, Tensor] = field(default_factory=dict)
    #: reference log-probs computed in the step, cached on their pairs once read
    uncached: list[UncachedReferences] = field(default_factory=list)

    def add(self, name: str, value: Tensor) -> None:
        """Accumulate ``value`` into the sum ``name`` (float64, on the device)."""
        value = value.detach().double()
        self.values[name] = value if name not in self.values else self.values[name] + value

    def read(
        self, extra: dict[str, Tensor] | None = None
    ) -> tuple[dict[str, float], dict[str, float]]:
        """``(sums, extra)`` as host floats, from one device-to-host transfer.

        Sums no micro-batch added read 0.0; ``extra`` holds 0-dim tensors on the same
        device (e.g. the gradient norm)."""
        extra = extra or {}
        names = [*self.values, *extra]
        scalars = [*self.values.values(), *(_plain(v).detach().double() for v in extra.values())]
        pending = [u.values.reshape(-1) for u in self.uncached]
        host: list[float] = []
        if scalars or pending:
            parts = ([torch.stack(scalars)] if scalars else []) + pending
            host = torch.cat(parts).tolist()  # the one read
        read = dict(zip(names, host))
        offset = len(scalars)
        for u in self.uncached:
            size = u.values.numel()
            u.cache(host[offset : offset + size])
            offset += size
        sums = {name: read.get(name, 0.0) for name in _sum_names()}
        return sums, {name: read[name] for name in extra}


def _plain(value: Tensor) -> Tensor:
    """A DTensor (a sharded model's gradient norm) as the plain tensor it stands for."""
    full = getattr(value, "full_tensor", None)
    return full() if callable(full) else value


def _sum_names() -> list[str]:
    return [
        "loss",
        *(f"sum/{name}" for name in COMPONENTS),
        *(f"stat/{name}" for name in _STATS),
        *(f"{name}/{part}" for name in REF_KL_SAMPLE_METRICS for part in ("sum", "n")),
    ]


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
    touches the optimizer, so it composes with gradient clipping and DiLoCo). The host
    reads the device once, for the metrics at the end (:class:`StepSums`).

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
    sums = accumulate_step(
        policy,
        batches,
        config,
        teacher=teacher,
        reference=reference,
        count_reducer=count_reducer,
    )
    parts, _ = sums.read()
    return step_metrics(parts, sums.counts, metric_reducer)


def accumulate_step(
    policy: Any,
    batches: Sequence[MicroBatch],
    config: LossConfig | None = None,
    *,
    teacher: Any | None = None,
    reference: Any | None = None,
    count_reducer: Callable[[dict[str, int]], dict[str, int]] | None = None,
) -> StepSums:
    """:func:`train_step`'s forward + backward, its sums left on the device (read them with
    :meth:`StepSums.read`, then :func:`step_metrics`): nothing here waits for the device."""
    cfg = config or LossConfig()
    counts = component_counts(batches)  # counted when packing: no device read
    if count_reducer is not None:
        counts = count_reducer(counts)
    sums = StepSums(counts)
    device = lm_head_weight(policy).device
    for mb in batches:
        if mb.n_rows == 0 and not mb.pairs:
            continue
        mb = mb.to(device)  # packed on the host; the step runs where the policy lives
        parts = _micro_batch_losses(policy, mb, cfg, teacher, reference, sums)
        loss = parts.pop("_anchor")
        for name, value in parts.items():
            if counts[name] == 0:
                continue
            sums.add(f"sum/{name}", value)
            loss = loss + cfg.coefficient(name) * value / counts[name]
        loss.backward()
        sums.add("loss", loss)
    return sums


def step_metrics(
    parts: dict[str, float],
    counts: dict[str, int],
    metric_reducer: Callable[[dict[str, float]], dict[str, float]] | None = None,
) -> dict[str, float]:
    """The step's metrics (see :func:`train_step`) from its read sums, summed over the
    data-parallel ranks first by ``metric_reducer``."""
    if metric_reducer is not None:
        parts = metric_reducer(parts)
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
    sums: StepSums,
) -> dict[str, Tensor]:
    """Component sums of one micro-batch (unnormalised) plus a zero ``_anchor`` with grad."""
    parts: dict[str, Tensor] = {}
    anchor = None
    if mb.n_rows:
        hidden = last_hidden_states(
            policy, mb.input_ids, mb.attention_mask, row_tokens=mb.row_tokens()
        )
        # read after the forward: a sharded (FSDP2) policy gathers the weight in it
        weight = lm_head_weight(policy)
        logprobs, entropy = token_logprobs_from_hidden(
            hidden[:, :-1],
            weight,
            _weighted_targets(mb),
            temperature=cfg.log_temperature,
            chunk_size=cfg.chunk_size,
            return_entropy=True,
            rows=mb.head_rows,
        )
        # An exact zero on the graph: every micro-batch backpropagates, even an empty one.
        anchor = 0.0 * logprobs.sum()
        _add_token_components(parts, mb, cfg, logprobs, entropy, sums)
        if mb.counts["jsd"]:  # counted on the host
            parts["jsd"] = _jsd_sum(policy if teacher is None else teacher, hidden, weight, mb, cfg)
    if mb.pairs:
        parts["dpo"] = _dpo_sum(policy, reference, mb, cfg, sums)
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
    sums: StepSums,
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
        sums.add("stat/live", live.sum())
        sums.add("stat/masked", (live & ~keep).sum())
        sums.add("stat/kl", ((log_r.exp() - 1 - log_r) * live).sum())
        sums.add("stat/entropy", (entropy * (mask != 0)).sum())
        sums.add("stat/trainable", (mask != 0).sum())
        sums.add("stat/tokens", mb.attention_mask.sum())
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
        # which rows have ref_kl tokens depends on the trust mask: masked sums, no selection
        values, has_tokens = ref_kl_row_metrics(
            logprobs, inf, ref, mask, ref_w, mask_low=cfg.mask_low
        )
        for name, value in ref_kl_row_sums(values, has_tokens).items():
            sums.add(name, value)


def _jsd_sum(
    teacher: Any, hidden: Tensor, weight: Tensor, mb: MicroBatch, cfg: LossConfig
) -> Tensor:
    rows, student, teacher_positions, slots = mb.jsd_tokens
    tokens = AlignedTokens(rows, student, teacher_positions, mb.jsd_rows, slots)
    per_token = divergence_terms(
        hidden,
        weight,
        teacher,
        mb.teacher_input_ids,
        mb.teacher_attention_mask,
        tokens,
        divergence_settings_of(cfg),
        teacher_tokens=mb.teacher_tokens(),
    )
    value, _ = weighted_token_loss(per_token, mb.jsd_weights[tokens.rows, tokens.student])
    return value


def _dpo_sum(
    policy: Any, reference: Any | None, mb: MicroBatch, cfg: LossConfig, sums: StepSums
) -> Tensor:
    settings = pair_settings_of(cfg)
    references = None
    if settings.needs_reference:
        references, uncached = reference_logps(
            reference, mb.pairs, device=mb.device, chunk_size=cfg.chunk_size
        )
        if uncached is not None:  # cached on the pairs with the step's one read
            sums.uncached.append(uncached)
    per_pair = pair_terms(
        policy,
        mb.pairs,
        settings,
        chunk_size=cfg.chunk_size,
        rows=mb.pair_rows,
        references=references,
    )
    return (mb.pair_rows.weights.to(per_pair.dtype) * per_pair).sum()
