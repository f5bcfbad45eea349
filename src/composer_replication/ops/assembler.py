"""The loss assembler: one packed micro-batch in, per-component sums out.

This is the only place where the loss components meet the model. Every path that trains
calls :func:`micro_batch_losses` on a :class:`~composer_replication.samples.wire.MicroBatch`:

- the native trainer step (:mod:`composer_replication.training.step`) on the micro-batches
  it packed from the algorithms' samples;
- ``loss.compose_loss`` after converting its padded batch dict into samples;
- the trl trainer (``ComposerReplicationTrainer``) for its self-distillation and
  trace-replay channels, after converting its inputs the same way.

The assembler returns each component's UNNORMALISED sum (``rl``, ``ce``, ``ref_kl``,
``jsd``, ``dpo``, and any registered one); it runs the shared forward and head once, then
calls each declared component's ``compute`` function
(:mod:`composer_replication.config.components`) on a :class:`ComponentInputs`. The caller divides by the component's token (pair) count, which packing
already counted on the host (``MicroBatch.counts``), over whatever span it normalises
(one batch, or every micro-batch of an optimizer step). Nothing here reads the device.

The math of each component lives beside it in ``ops``: :mod:`.token_losses` (rl with the
DPPO trust region, ce, ref_kl, the k2 trust mask), :mod:`.self_distillation` (jsd),
:mod:`.pairs` (DPO / SimPO), :mod:`.trust_region` (the ref_kl metrics).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from composer_replication.common.callables import load_callable
from composer_replication.config.components import loss_components
from composer_replication.config.loss import LossConfig
from composer_replication.model.parts import last_hidden_states, lm_head_weight
from composer_replication.ops.divergence import (
    DIVERGENCE_KNOBS,
    DivergenceSettings,
    divergence_settings,
)
from composer_replication.ops.head import (
    IGNORE_INDEX,
    cross_entropy_from_hidden,
    token_logprobs_from_hidden,
)
from composer_replication.ops.pairs import (
    PAIR_KNOBS,
    PairLossSettings,
    UncachedReferences,
    pair_loss_settings,
    pair_terms,
    reference_logps,
)
from composer_replication.ops.self_distillation import AlignedTokens, divergence_terms
from composer_replication.ops.token_losses import (
    ce_loss,
    dppo_keep_mask,
    k2_trust_mask,
    ref_kl_loss,
    rl_loss,
    weighted_token_loss,
)
from composer_replication.ops.trust_region import (
    mismatch_kl,
    ref_kl_row_metrics,
    ref_kl_row_sums,
)

if TYPE_CHECKING:
    from torch import Tensor

    from composer_replication.samples.wire import MicroBatch

__all__ = [
    "ComponentInputs",
    "MicroBatchLosses",
    "ce_term",
    "divergence_settings_of",
    "dpo_term",
    "jsd_term",
    "micro_batch_losses",
    "pair_settings_of",
    "ref_kl_term",
    "rl_loss_of",
    "rl_term",
]


def rl_loss_of(cfg: LossConfig) -> Callable[..., Any]:
    """The rl component's function of ``(logprobs, inference_logprobs, advantages,
    loss_mask, weights)``: the default DPPO loss with ``cfg``'s knobs, or the custom one
    (imported once; a bad ``import_path`` is a one-line ``ValueError`` naming it)."""
    if cfg.type == "custom":
        return functools.partial(_custom_rl_loss(cfg.import_path), **cfg.kwargs)
    return functools.partial(
        rl_loss,
        mask_low=cfg.mask_low,
        mask_high=cfg.mask_high,
        adv_tau=cfg.adv_tau,
        kl_tau=cfg.kl_tau,
    )


@functools.lru_cache(maxsize=8)
def _custom_rl_loss(import_path: str) -> Callable[..., Any]:
    return load_callable(import_path, "loss.import_path (custom rl loss)")


def divergence_settings_of(cfg: LossConfig) -> DivergenceSettings:
    """The jsd component's divergence as ``cfg`` sets it (``taid_t`` must be resolved)."""
    knobs = {k: getattr(cfg, k) for k in DIVERGENCE_KNOBS}
    return divergence_settings(**knobs, chunk_size=cfg.chunk_size, top_k=cfg.sdpo_top_k)


def pair_settings_of(cfg: LossConfig) -> PairLossSettings:
    """The dpo component's pair loss as ``cfg`` sets it."""
    return pair_loss_settings(**{k: getattr(cfg, k) for k in PAIR_KNOBS})


@dataclass
class MicroBatchLosses:
    """One micro-batch's component sums, all still on the device.

    Attributes:
        components: component name -> its unnormalised sum (with grad); only the
            components the micro-batch carries.
        anchor: an exact zero on the graph, so a micro-batch whose components are all
            skipped still backpropagates (every rank runs the same collectives).
        stats: metric sums without grad: ``stat/live`` (rl tokens with a weight),
            ``stat/masked`` (those outside the trust region), ``stat/kl`` (k3 estimate of
            KL(sampler || trainer) summed over live tokens), ``stat/entropy`` and
            ``stat/trainable`` (trainable tokens), ``stat/tokens`` (attended tokens), and
            the ref_kl sample metrics' sums.
        uncached: reference log-probs computed here for pairs that had none cached (cache
            them when the values reach the host).
    """

    components: dict[str, Tensor]
    anchor: Tensor
    stats: dict[str, Tensor] = field(default_factory=dict)
    uncached: UncachedReferences | None = None

    def weighted_total(self, scales: dict[str, float]) -> Tensor:
        """``anchor + sum_c scales[c] * components[c]`` over the components present (a
        component whose scale is missing or 0 is skipped)."""
        total = self.anchor
        for name, value in self.components.items():
            scale = scales.get(name, 0.0)
            if scale:
                total = total + scale * value
        return total


@dataclass
class ComponentInputs:
    """What a component's ``compute`` function reads: the micro-batch, the settings, and the
    shared forward's results (None when the micro-batch has no rows: pair-only).

    Attributes:
        policy, mb, cfg: the trainable model, the packed micro-batch, the loss settings.
        hidden: (B, T, H) last hidden states of the rows.
        weight: the LM head's weight.
        logprobs: (B, T-1) log-probs of each next token under the policy (0 where no
            component needs it); entropy: (B, T-1) the policy's entropy there.
        teacher, reference, divergence: the jsd teacher, the frozen reference, the jsd
            divergence (see :func:`micro_batch_losses`).
        stats: metric sums without grad a component adds (``stat/<name>``).
        uncached: reference log-probs a component computed that the caller should cache.
    """

    policy: Any
    mb: MicroBatch
    cfg: LossConfig
    hidden: Tensor | None = None
    weight: Tensor | None = None
    logprobs: Tensor | None = None
    entropy: Tensor | None = None
    teacher: Any | None = None
    reference: Any | None = None
    divergence: DivergenceSettings | None = None
    stats: dict[str, Tensor] = field(default_factory=dict)
    uncached: UncachedReferences | None = None

    def stream(self, name: str) -> Tensor:
        """The (B, T-1) weights of stream ``name`` aligned with ``logprobs`` (token t+1)."""
        return self.mb.stream(name)[:, 1:]


def micro_batch_losses(
    policy: Any,
    mb: MicroBatch,
    cfg: LossConfig | None = None,
    *,
    teacher: Any | None = None,
    reference: Any | None = None,
    divergence: DivergenceSettings | None = None,
) -> MicroBatchLosses:
    """Every component's sum over ``mb`` (on ``policy``'s device), with its metric sums.

    Args:
        policy: the trainable causal LM (PEFT-wrapped, FSDP2-sharded or plain).
        mb: a packed micro-batch on the policy's device.
        cfg: the component settings (default :class:`LossConfig`).
        teacher: the model behind the jsd teacher contexts (default ``policy``, under
            ``no_grad``: the live policy teaches itself through the hint).
        reference: the frozen initial policy, for DPO reference log-probs a pair lacks.
        divergence: the jsd divergence, when it is not ``cfg``'s (``compose_loss`` takes a
            ``TAIDScheduler`` for ``taid_t``, which a config cannot hold).
    """
    cfg = cfg or LossConfig()
    inputs = ComponentInputs(
        policy,
        mb,
        cfg,
        teacher=policy if teacher is None else teacher,
        reference=reference,
        divergence=divergence,
    )
    anchor = None
    if mb.n_rows:
        inputs.hidden = last_hidden_states(
            policy, mb.input_ids, mb.attention_mask, row_tokens=mb.row_tokens()
        )
        # read after the forward: a sharded (FSDP2) policy gathers the weight in it
        inputs.weight = lm_head_weight(policy)
        inputs.logprobs, inputs.entropy = token_logprobs_from_hidden(
            inputs.hidden[:, :-1],
            inputs.weight,
            _weighted_targets(mb),
            temperature=cfg.log_temperature,
            chunk_size=cfg.chunk_size,
            return_entropy=True,
            rows=mb.head_rows,
        )
        anchor = 0.0 * inputs.logprobs.sum()
        _step_stats(inputs)
    components: dict[str, Tensor] = {}
    for component in loss_components():
        value = _compute_of(component.compute)(inputs)
        if value is not None:
            components[component.name] = value
            if anchor is None:
                anchor = 0.0 * value
    if anchor is None:
        anchor = torch.zeros((), device=mb.device, requires_grad=True)
    return MicroBatchLosses(components, anchor, inputs.stats, inputs.uncached)


@functools.lru_cache(maxsize=64)
def _compute_of(import_path: str) -> Callable[[ComponentInputs], Tensor | None]:
    return load_callable(import_path, "a loss component's compute function")


def _weighted_targets(mb: MicroBatch) -> Tensor:
    """Next-token targets, ``IGNORE_INDEX`` where no component reads the log-prob (prompts,
    padding): the head then skips those positions (their log-prob reads 0)."""
    needed = mb.loss_mask[:, 1:] != 0
    for component in loss_components():
        weights = mb.stream(component.stream) if component.stream else None
        if component.head_tokens and component.counts == "weighted" and weights is not None:
            needed = needed | (weights[:, 1:] != 0)
    return mb.input_ids[:, 1:].masked_fill(~needed, IGNORE_INDEX)


def _step_stats(inputs: ComponentInputs) -> None:
    """The step's metric sums over the rows (no grad): the rl tokens with a weight and
    those outside the trust region, the sampler/trainer mismatch KL (k3) over them, the
    policy's entropy over trainable tokens, trainable and attended tokens."""
    mb, cfg, logprobs = inputs.mb, inputs.cfg, inputs.logprobs
    mask = mb.loss_mask[:, 1:]
    inf = mb.inference_logprobs[:, 1:]
    with torch.no_grad():
        live = (mask != 0) & (mb.rl_weights[:, 1:] != 0)
        keep = dppo_keep_mask(
            logprobs,
            inf,
            mb.advantages[:, 1:],
            mask,
            mask_low=cfg.mask_low,
            mask_high=cfg.mask_high,
        )
        inputs.stats["stat/live"] = live.sum()
        inputs.stats["stat/masked"] = (live & ~keep).sum()
        inputs.stats["stat/kl"] = (mismatch_kl(logprobs, inf) * live).sum()
        inputs.stats["stat/entropy"] = (inputs.entropy * (mask != 0)).sum()
        inputs.stats["stat/trainable"] = (mask != 0).sum()
        inputs.stats["stat/tokens"] = mb.attention_mask.sum()


def rl_term(inputs: ComponentInputs) -> Tensor | None:
    """The ``rl`` component: the rl loss (default DPPO or the custom one) over rl weights."""
    if inputs.logprobs is None:
        return None
    mb = inputs.mb
    return _rl_sum(
        inputs.cfg,
        inputs.logprobs,
        mb.inference_logprobs[:, 1:],
        mb.advantages[:, 1:],
        mb.loss_mask[:, 1:],
        inputs.stream("rl_weights"),
    )


def ce_term(inputs: ComponentInputs) -> Tensor | None:
    """The ``ce`` component: weighted cross-entropy (label-smoothed when set)."""
    if inputs.logprobs is None or inputs.mb.ce_weights is None:
        return None
    if inputs.cfg.lm_ce_label_smoothing:
        return _smoothed_ce_sum(inputs.hidden, inputs.weight, inputs.mb, inputs.cfg)
    value, _ = ce_loss(inputs.logprobs, inputs.stream("ce_weights"))
    return value


def ref_kl_term(inputs: ComponentInputs) -> Tensor | None:
    """The ``ref_kl`` component (with the k2 trust mask when set) and its row metrics."""
    mb, cfg, logprobs = inputs.mb, inputs.cfg, inputs.logprobs
    if logprobs is None or mb.ref_kl_weights is None:
        return None
    mask = mb.loss_mask[:, 1:]
    inf = mb.inference_logprobs[:, 1:]
    ref = mb.ref_logprobs[:, 1:]
    ref_w = inputs.stream("ref_kl_weights")
    if cfg.kl_token_trust_threshold is not None:
        untrusted = k2_trust_mask(logprobs, ref, cfg.kl_token_trust_threshold)
        ref_w = ref_w.masked_fill(untrusted, 0.0)
    value, _ = ref_kl_loss(
        logprobs, inf, ref, mask, ref_w, mask_low=cfg.mask_low, kl_tau=cfg.kl_tau
    )
    # which rows have ref_kl tokens depends on the trust mask: masked sums, no selection
    with torch.no_grad():
        values, has_tokens = ref_kl_row_metrics(
            logprobs, inf, ref, mask, ref_w, mask_low=cfg.mask_low
        )
        inputs.stats.update(ref_kl_row_sums(values, has_tokens))
    return value


def jsd_term(inputs: ComponentInputs) -> Tensor | None:
    """The ``jsd`` component: the divergence to the teacher context, per jsd token."""
    mb = inputs.mb
    if inputs.hidden is None or not mb.counts.get("jsd"):  # counted on the host
        return None
    return _jsd_sum(
        inputs.teacher,
        inputs.hidden,
        inputs.weight,
        mb,
        inputs.divergence or divergence_settings_of(inputs.cfg),
    )


def dpo_term(inputs: ComponentInputs) -> Tensor | None:
    """The ``dpo`` component: the pairs' DPO / SimPO loss (reference log-probs computed for
    pairs that lack them, left in ``inputs.uncached`` for the caller to cache)."""
    if not inputs.mb.pairs:
        return None
    value, inputs.uncached = _dpo_sum(inputs.policy, inputs.reference, inputs.mb, inputs.cfg)
    return value


#: how a custom rl loss is called, for the messages that blame it
CUSTOM_LOSS_CALL = (
    "fn(logprobs, inference_logprobs, advantages, loss_mask, weights, **loss.kwargs) with "
    "(rows, tokens) tensors, returning the sum over the batch's tokens as a 0-d tensor"
)


def _rl_sum(
    cfg: LossConfig, logprobs: Tensor, inf: Tensor, adv: Tensor, mask: Tensor, weights: Tensor
) -> Tensor:
    from composer_replication.common.errors import UsageError, user_code_error

    if cfg.type != "custom":
        value = rl_loss_of(cfg)(logprobs, inf, adv, mask, weights)
        return value[0] if isinstance(value, tuple) else value
    try:
        value = rl_loss_of(cfg)(logprobs, inf, adv, mask, weights)
    except Exception as err:  # the user's code: blame it, in one line
        raise user_code_error(
            f"loss.import_path = {cfg.import_path!r}", err, f"it is called as {CUSTOM_LOSS_CALL}"
        ) from err
    total = value[0] if isinstance(value, tuple) else value
    if not isinstance(total, torch.Tensor) or total.dim() != 0:
        shape = tuple(total.shape) if isinstance(total, torch.Tensor) else type(total).__name__
        raise UsageError(
            f"loss.import_path = {cfg.import_path!r} returned {shape}; the rl loss must "
            "return the sum over the batch's tokens as a 0-d tensor"
        )
    return total


def _smoothed_ce_sum(hidden: Tensor, weight: Tensor, mb: MicroBatch, cfg: LossConfig) -> Tensor:
    """The ce sum with label smoothing (arXiv 1512.00567): a second head pass over the ce
    tokens, which must all weigh 1 (smoothing needs the mean log-prob over the vocabulary,
    which the per-token head does not return)."""
    weights = {w for s in mb.row_samples for w in (s.ce_weights or [])[1:]}
    if not weights <= {0.0, 1.0}:
        raise ValueError(
            f"loss.lm_ce_label_smoothing={cfg.lm_ce_label_smoothing} needs ce weights of 0 or "
            f"1, got {sorted(weights - {0.0, 1.0})[:3]}; set it to 0 for weighted ce tokens"
        )
    targets = mb.input_ids[:, 1:].masked_fill(mb.ce_weights[:, 1:] == 0, IGNORE_INDEX)
    return cross_entropy_from_hidden(
        hidden[:, :-1],
        weight,
        targets,
        reduction="sum",
        temperature=cfg.log_temperature,
        chunk_size=cfg.chunk_size,
        label_smoothing=cfg.lm_ce_label_smoothing,
    )


def _jsd_sum(
    teacher: Any, hidden: Tensor, weight: Tensor, mb: MicroBatch, divergence: DivergenceSettings
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
        divergence,
        teacher_tokens=mb.teacher_tokens(),
    )
    value, _ = weighted_token_loss(per_token, mb.jsd_weights[tokens.rows, tokens.student])
    return value


def _dpo_sum(
    policy: Any, reference: Any | None, mb: MicroBatch, cfg: LossConfig
) -> tuple[Tensor, UncachedReferences | None]:
    settings = pair_settings_of(cfg)
    references = uncached = None
    if settings.needs_reference:
        references, uncached = reference_logps(
            reference, mb.pairs, device=mb.device, chunk_size=cfg.chunk_size
        )
    per_pair = pair_terms(
        policy,
        mb.pairs,
        settings,
        chunk_size=cfg.chunk_size,
        rows=mb.pair_rows,
        references=references,
    )
    return (mb.pair_rows.weights.to(per_pair.dtype) * per_pair).sum(), uncached
