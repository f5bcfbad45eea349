"""Preference pairs: summed response log-probs, reference caching, and the DPO / SimPO
reductions: the trace-replay channel's one implementation.

A pair is a :class:`~composer_replication.samples.wire.DPOPairTokens` (chosen and rejected token
ids with response masks, a weight, and the reference log-probs once known). Both sides of
a batch of pairs run in ONE forward pass (chosen rows, then rejected rows, right-padded to
one width) on the chunked hidden-state path. The frozen reference's summed log-probs are
computed once per pair and cached on it (:func:`fill_reference_logps`), so a pair re-drawn
in a later step never pays for them again.

- DPO (arXiv 2305.18290): ``-log sigmoid(beta * ((c - c_ref) - (r - r_ref)))`` on summed
  response log-probs, with optional cDPO label smoothing;
- SimPO (arXiv 2405.14734): ``-log sigmoid(simpo_beta * (c/|c| - r/|r|) - gamma)`` on
  length-normalised log-probs, reference-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from composer_replication.config.loss import PAIR_KNOBS
from composer_replication.model.parts import last_hidden_states, lm_head_weight
from composer_replication.ops.dpo import dpo_loss
from composer_replication.ops.head import IGNORE_INDEX, token_logprobs_from_hidden
from composer_replication.ops.simpo import simpo_loss
from composer_replication.samples.padding import pad_rows
from composer_replication.samples.wire import DPOPairTokens, PairRows, pair_rows, to_device

if TYPE_CHECKING:
    from torch import Tensor

PAIR_VARIANTS = ("dpo", "simpo")
#: The knobs of the trace-replay channel, named alike in ``compose_loss``,
#: ``ComposerReplicationTrainer`` and the run config's ``[loss]`` table.

__all__ = [
    "PAIR_KNOBS",
    "PAIR_VARIANTS",
    "PairLossSettings",
    "UncachedReferences",
    "fill_reference_logps",
    "pad_rows",
    "pair_logps",
    "pair_loss_settings",
    "pair_losses",
    "pair_terms",
    "pairs_from_padded",
    "reference_logps",
    "sequence_logps",
    "set_reference_logps",
]


@dataclass(frozen=True)
class PairLossSettings:
    """The pair loss and its knobs.

    Attributes:
        variant: ``"dpo"`` (reference log-probs used) or ``"simpo"`` (reference-free).
        beta: DPO's beta (> 0).
        simpo_beta / simpo_gamma: SimPO's reward scale (> 0) and target margin (>= 0).
        label_smoothing: cDPO's assumed label-flip probability in [0, 0.5) (dpo only).
    """

    variant: str = "dpo"
    beta: float = 0.1
    simpo_beta: float = 2.0
    simpo_gamma: float = 1.0
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        if self.variant not in PAIR_VARIANTS:
            raise ValueError(f"dpo_variant={self.variant!r} is not one of {PAIR_VARIANTS}")
        if not self.beta > 0:
            raise ValueError(f"replay_dpo_beta={self.beta} must be > 0")
        if not self.simpo_beta > 0:
            raise ValueError(f"simpo_beta={self.simpo_beta} must be > 0")
        if not self.simpo_gamma >= 0:
            raise ValueError(f"simpo_gamma={self.simpo_gamma} must be >= 0")

    @property
    def needs_reference(self) -> bool:
        return self.variant == "dpo"


def pair_loss_settings(
    *,
    dpo_variant: str = "dpo",
    replay_dpo_beta: float = 0.1,
    simpo_beta: float = 2.0,
    simpo_gamma: float = 1.0,
) -> PairLossSettings:
    """The trace-replay channel's settings from its public knob names (:data:`PAIR_KNOBS`)."""
    if dpo_variant not in PAIR_VARIANTS:
        raise ValueError(f"dpo_variant={dpo_variant!r} is not one of {PAIR_VARIANTS}")
    return PairLossSettings(
        variant=dpo_variant, beta=replay_dpo_beta, simpo_beta=simpo_beta, simpo_gamma=simpo_gamma
    )


def sequence_logps(
    model: Any,
    input_ids: Tensor,
    response_mask: Tensor,
    attention_mask: Tensor | None = None,
    *,
    chunk_size: int | None = None,
    row_tokens: Sequence[Sequence[int]] | None = None,
    head_rows: Tensor | None = None,
) -> Tensor:
    """(B,) summed log-probs of the response tokens, on the hidden-state path.

    Token 0 has no log-prob, so a response mask on it is ignored. ``row_tokens`` (each
    row's ids, host lists) and ``head_rows`` (flat indices into (B, T - 1) of the response
    tokens after the first position), when the caller has them from host data, spare the
    forward and the head their reads of the device.
    """
    if response_mask.shape != input_ids.shape:
        raise ValueError(
            f"response_mask {tuple(response_mask.shape)} must match input_ids "
            f"{tuple(input_ids.shape)}"
        )
    hidden = last_hidden_states(model, input_ids, attention_mask, row_tokens=row_tokens)
    targets = input_ids[:, 1:].masked_fill(response_mask[:, 1:] == 0, IGNORE_INDEX)
    logprobs = token_logprobs_from_hidden(
        hidden[:, :-1], lm_head_weight(model), targets, chunk_size=chunk_size, rows=head_rows
    )
    return logprobs.sum(-1)


def pair_logps(
    model: Any,
    pairs: Sequence[DPOPairTokens],
    *,
    chunk_size: int | None = None,
    rows: PairRows | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(chosen, rejected, n_chosen, n_rejected)``, each (P,): summed response log-probs of
    both sides (one forward pass) and their response-token counts.

    ``rows``: the pairs already padded (:func:`~composer_replication.samples.wire.pair_rows`, as a
    packed micro-batch carries them); built here otherwise."""
    device = lm_head_weight(model).device
    rows = (pair_rows(pairs) if rows is None else rows).to(device)
    logps = sequence_logps(
        model,
        rows.input_ids,
        rows.response_mask,
        rows.attention_mask,
        chunk_size=chunk_size,
        row_tokens=rows.tokens,
        head_rows=rows.head_rows,
    )
    counts = rows.response_mask[:, 1:].sum(-1).clamp_min(1)
    k = len(pairs)
    return logps[:k], logps[k:], counts[:k], counts[k:]


def set_reference_logps(
    pairs: Sequence[DPOPairTokens], chosen: Sequence[float], rejected: Sequence[float]
) -> None:
    """Cache reference log-probs on the pairs (one value per pair and side)."""
    for pair, c, r in zip(pairs, chosen, rejected, strict=True):
        pair.ref_chosen_logp, pair.ref_rejected_logp = float(c), float(r)


def missing_reference(pairs: Sequence[DPOPairTokens]) -> list[DPOPairTokens]:
    """The pairs whose reference log-probs are not cached yet."""
    return [p for p in pairs if p.ref_chosen_logp is None or p.ref_rejected_logp is None]


@torch.no_grad()
def fill_reference_logps(
    reference: Any,
    pairs: Sequence[DPOPairTokens],
    *,
    batch_size: int = 8,
    chunk_size: int | None = None,
) -> None:
    """Compute and cache the reference's log-probs on the pairs that lack them.

    ``reference`` is the frozen initial policy (a model, or an ``AdapterDisabled`` view of
    a LoRA policy); ``batch_size`` pairs run per forward pass.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    todo = missing_reference(pairs)
    for start in range(0, len(todo), batch_size):
        chunk = todo[start : start + batch_size]
        chosen, rejected, _, _ = pair_logps(reference, chunk, chunk_size=chunk_size)
        set_reference_logps(chunk, chosen.tolist(), rejected.tolist())


@dataclass
class UncachedReferences:
    """Reference log-probs computed for pairs that had none cached, still on the device:
    whoever reads them to the host (with its other values, in one transfer) caches them."""

    pairs: list[DPOPairTokens]
    #: (2, K) float64: chosen then rejected log-probs of ``pairs``
    values: Tensor

    def cache(self, values: Sequence[float]) -> None:
        """Store the read ``values`` (``self.values`` flattened, as host floats) on the pairs."""
        k = len(self.pairs)
        set_reference_logps(self.pairs, values[:k], values[k:])


@torch.no_grad()
def reference_logps(
    reference: Any | None,
    pairs: Sequence[DPOPairTokens],
    *,
    device: Any,
    batch_size: int = 8,
    chunk_size: int | None = None,
) -> tuple[Tensor, UncachedReferences | None]:
    """(2, P) float64 reference log-probs of the pairs (chosen row, rejected row) on
    ``device``, without reading the device: cached values come from the pairs, the others
    from ``reference`` (``batch_size`` pairs per forward, as :func:`fill_reference_logps`),
    returned as :class:`UncachedReferences` for the caller to cache once it reads them."""
    slots = [i for i, p in enumerate(pairs) if None in (p.ref_chosen_logp, p.ref_rejected_logp)]
    missing = [pairs[i] for i in slots]
    known = [[getattr(p, f"ref_{side}_logp") for p in pairs] for side in ("chosen", "rejected")]
    cached = [[float("nan") if v is None else v for v in side] for side in known]
    values = to_device(torch.tensor(cached, dtype=torch.float64, device="cpu"), device)
    if not missing:
        return values, None
    if reference is None:
        raise ValueError(
            "a DPO pair has no reference log-probs and no reference model was given: "
            "score the pairs first (Algorithm.score) or pass the frozen initial policy"
        )
    parts = []
    for start in range(0, len(missing), batch_size):
        chosen, rejected, _, _ = pair_logps(
            reference, missing[start : start + batch_size], chunk_size=chunk_size
        )
        parts.append(torch.stack([chosen, rejected]).double())
    computed = torch.cat(parts, dim=1)
    index = to_device(torch.tensor(slots, dtype=torch.long, device="cpu"), device)
    values = values.index_copy(1, index, computed.to(values.device))
    return values, UncachedReferences(missing, computed)


def pair_losses(
    chosen: Tensor,
    rejected: Tensor,
    n_chosen: Tensor,
    n_rejected: Tensor,
    settings: PairLossSettings,
    ref_chosen: Tensor | None = None,
    ref_rejected: Tensor | None = None,
) -> Tensor:
    """(P,) per-pair loss from summed log-probs (and counts, for SimPO's averages)."""
    if settings.variant == "simpo":
        return simpo_loss(
            chosen / n_chosen.to(chosen.dtype),
            rejected / n_rejected.to(rejected.dtype),
            beta=settings.simpo_beta,
            gamma=settings.simpo_gamma,
            reduction="none",
        )
    if ref_chosen is None or ref_rejected is None:
        raise ValueError("DPO needs reference log-probs for every pair")
    return dpo_loss(
        chosen,
        rejected,
        ref_chosen.to(chosen.dtype),
        ref_rejected.to(chosen.dtype),
        beta=settings.beta,
        label_smoothing=settings.label_smoothing,
        reduction="none",
    )


def pair_terms(
    policy: Any,
    pairs: Sequence[DPOPairTokens],
    settings: PairLossSettings,
    *,
    reference: Any | None = None,
    chunk_size: int | None = None,
    rows: PairRows | None = None,
    references: Tensor | None = None,
) -> Tensor:
    """(P,) per-pair loss of ``policy`` on ``pairs`` (with grad).

    DPO reference log-probs: ``references`` ((2, P), from :func:`reference_logps`) when
    given; else from the pairs' cache, pairs without them scored once by ``reference`` (and
    cached). SimPO needs none. ``rows``: as in :func:`pair_logps`.
    """
    if settings.needs_reference and references is None and missing_reference(pairs):
        if reference is None:
            raise ValueError(
                "a DPO pair has no reference log-probs and no reference model was given: "
                "score the pairs first (Algorithm.score) or pass the frozen initial policy"
            )
        fill_reference_logps(reference, pairs, chunk_size=chunk_size)
    chosen, rejected, n_chosen, n_rejected = pair_logps(
        policy, pairs, chunk_size=chunk_size, rows=rows
    )
    refs: tuple[Tensor | None, Tensor | None] = (None, None)
    if settings.needs_reference:
        if references is None:
            references, _ = reference_logps(None, pairs, device=chosen.device)
        refs = (references[0].to(chosen.dtype), references[1].to(chosen.dtype))
    return pair_losses(chosen, rejected, n_chosen, n_rejected, settings, *refs)


def pairs_from_padded(
    chosen: tuple[Tensor, Tensor, Tensor | None],
    rejected: tuple[Tensor, Tensor, Tensor | None],
    *,
    ref_chosen: Tensor | None = None,
    ref_rejected: Tensor | None = None,
    weight: float = 1.0,
) -> list[DPOPairTokens]:
    """Padded (P, T) pair rows back into ``DPOPairTokens``.

    ``chosen`` / ``rejected`` are ``(input_ids, response_mask, attention_mask or None)``;
    each row keeps its attended tokens (all of them without an attention mask). Reference
    log-probs, when given, are (P,) sums or (P, T) per-token values summed over the
    response tokens after the first position.
    """
    sides = []
    for name, (ids, response, attention) in (("chosen", chosen), ("rejected", rejected)):
        if response.shape != ids.shape:
            raise ValueError(
                f"dpo_{name}_response_mask {tuple(response.shape)} must match "
                f"dpo_{name}_input_ids {tuple(ids.shape)}"
            )
        keep = torch.ones_like(ids, dtype=torch.bool) if attention is None else attention != 0
        sides.append(
            [
                (ids[b][keep[b]].tolist(), [int(m) for m in response[b][keep[b]].tolist()])
                for b in range(ids.shape[0])
            ]
        )
    if len(sides[0]) != len(sides[1]):
        raise ValueError(
            f"{len(sides[0])} chosen rows but {len(sides[1])} rejected rows; pairs need both"
        )
    refs = [
        _summed_reference(ref, side)
        for ref, side in ((ref_chosen, chosen), (ref_rejected, rejected))
    ]
    out = []
    for k, ((c_ids, c_mask), (r_ids, r_mask)) in enumerate(zip(*sides)):
        pair = DPOPairTokens(c_ids, c_mask, r_ids, r_mask, weight=weight)
        if refs[0] is not None and refs[1] is not None:
            pair.ref_chosen_logp, pair.ref_rejected_logp = refs[0][k], refs[1][k]
        out.append(pair)
    return out


def _summed_reference(
    ref: Tensor | None, side: tuple[Tensor, Tensor, Tensor | None]
) -> list[float] | None:
    if ref is None:
        return None
    ids, response, _ = side
    if ref.dim() == 1:
        if ref.shape[0] != ids.shape[0]:
            raise ValueError(
                f"reference log-probs {tuple(ref.shape)} do not match {ids.shape[0]} pairs"
            )
        return [float(v) for v in ref.tolist()]
    if ref.shape != ids.shape:
        raise ValueError(
            f"per-token reference log-probs {tuple(ref.shape)} must match the pair rows "
            f"{tuple(ids.shape)} (or be one sum per pair)"
        )
    mask = response.clone()
    mask[:, 0] = 0  # token 0 has no log-prob
    return (ref.to(torch.float64) * mask).sum(-1).tolist()
