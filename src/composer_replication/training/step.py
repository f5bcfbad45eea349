"""The algorithm-blind trainer step: execute the loss components over packed micro-batches.

For each component c the step computes ``sum_c`` over its weight stream and divides by
``N_c``, the count of tokens (pairs, for dpo) with a non-zero weight in that component
across ALL micro-batches of the step (optionally all-reduced over data-parallel ranks), so
gradient accumulation gives the same gradient as one big batch and components never dilute
each other. ``total = sum_c coef_c * sum_c / N_c``; backward runs once per micro-batch.

Each micro-batch's component sums come from the one loss assembler,
:func:`composer_replication.ops.assembler.micro_batch_losses` (the same call ``compose_loss``
and the trl trainer make); the step only normalises, weights and backpropagates them.

The step keeps a GPU busy: it never reads device values on the host mid-step (each read
waits for all queued work). Counts, row indices and pair rows come from packing (see
:class:`~composer_replication.samples.wire.MicroBatch`), micro-batches move to the device without
blocking, and every metric stays a device sum until one transfer at the end
(:class:`StepSums`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from composer_replication.config.components import component_names
from composer_replication.config.loss import COMPONENTS, LossConfig
from composer_replication.model.parts import lm_head_weight
from composer_replication.ops.assembler import micro_batch_losses
from composer_replication.ops.pairs import UncachedReferences
from composer_replication.ops.trust_region import (
    REF_KL_SAMPLE_METRICS,
    ref_kl_metrics_from_sums,
)
from composer_replication.samples.forward_tokens import ForwardTokens, counting_forward_tokens

if TYPE_CHECKING:
    from torch import Tensor

    from composer_replication.samples.wire import MicroBatch

__all__ = [
    "COMPONENTS",
    "LossConfig",
    "StepSums",
    "accumulate_step",
    "component_counts",
    "step_metrics",
    "train_step",
]

#: The sums behind a step's metrics (besides the per-component ones), in the order read.
_STATS = ("masked", "live", "kl", "entropy", "trainable", "tokens")
#: The sums counted on the host (the learner forwards' token positions), not read.
_HOST_STATS = ("forward_tokens", "padded_tokens")


def component_counts(batches: Sequence[MicroBatch]) -> dict[str, int]:
    """Per-component count of tokens (pairs) with a non-zero weight over all micro-batches
    (counted on the host when they were packed)."""
    counts = dict.fromkeys(component_names(), 0)
    for mb in batches:
        for name in counts:
            counts[name] += mb.counts.get(name, 0)
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
    #: token positions the step's forwards computed and padded (host ints)
    forward: ForwardTokens = field(default_factory=ForwardTokens)

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
        read["stat/forward_tokens"] = float(self.forward.computed)
        read["stat/padded_tokens"] = float(self.forward.padded)
        sums = {name: read.get(name, 0.0) for name in _sum_names()}
        return sums, {name: read[name] for name in extra}


def _plain(value: Tensor) -> Tensor:
    """A DTensor (a sharded model's gradient norm) as the plain tensor it stands for."""
    full = getattr(value, "full_tensor", None)
    return full() if callable(full) else value


def _sum_names() -> list[str]:
    return [
        "loss",
        *(f"sum/{name}" for name in component_names()),
        *(f"stat/{name}" for name in (*_STATS, *_HOST_STATS)),
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
        batches: micro-batches from :func:`composer_replication.samples.wire.pack_samples`.
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
        tokens), ``entropy`` (token-mean over trainable tokens), ``tokens/total``,
        ``tokens/forward`` (token positions the learner's forwards computed, padding
        included) and ``tokens/padding_fraction`` (the padding's share of them); when a
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
        with counting_forward_tokens(sums.forward):  # from host lengths: no device read
            losses = micro_batch_losses(policy, mb, cfg, teacher=teacher, reference=reference)
        scales = {}
        for name, value in losses.components.items():
            if counts[name]:
                sums.add(f"sum/{name}", value)
                scales[name] = cfg.coefficient(name) / counts[name]
        for name, value in losses.stats.items():
            sums.add(name, value)
        if losses.uncached is not None:  # cached on the pairs with the step's one read
            sums.uncached.append(losses.uncached)
        loss = losses.weighted_total(scales)
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
    for name in component_names():
        total = parts[f"sum/{name}"]
        metrics[f"loss/{name}"] = total / counts[name] if counts[name] else 0.0
        metrics[f"tokens/{name}"] = float(counts[name])
    metrics["rl/masked_fraction"] = stat["masked"] / stat["live"] if stat["live"] else 0.0
    metrics["kl/inference"] = stat["kl"] / stat["live"] if stat["live"] else 0.0
    metrics["entropy"] = stat["entropy"] / stat["trainable"] if stat["trainable"] else 0.0
    metrics["tokens/total"] = stat["tokens"]
    forward = stat.get("forward_tokens", 0.0)
    metrics["tokens/forward"] = forward
    metrics["tokens/padding_fraction"] = (
        stat.get("padded_tokens", 0.0) / forward if forward else 0.0
    )
    metrics.update(ref_kl_metrics_from_sums(parts))
    return metrics
