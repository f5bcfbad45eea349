"""``generalized_jsd_loss``: the generalized JSD between two (B, T, V) logit tensors.

The generalized Jensen-Shannon divergence of Agarwal et al. (GKD, arXiv 2306.13649, Eq. 1)
with exactly the conventions of trl's ``GKDTrainer.generalized_jsd_loss``: beta=0 is
forward KL(teacher||student), beta=1 is reverse KL(student||teacher), logits divided by the
temperature, the same reductions. Unlike that formulation, which materialises several
(B, T, V) buffers and lets autograd keep them, the divergence is computed chunk by chunk with
an analytic gradient (:mod:`composer_replication.ops.jsd`), so peak extra memory is
O(chunk * V) plus the one gradient buffer autograd must hand back.

Trainers never hold (B, T, V) logits at all: they call the hidden-state kernel of the same
module through :mod:`composer_replication.ops.divergence`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from composer_replication.ops.head import IGNORE_INDEX
from composer_replication.ops.jsd import (
    TINY_PROB,
    default_chunk_rows,
    jsd_rows,
    jsd_rows_with_grads,
    per_token_jsd,
)

if TYPE_CHECKING:
    from torch import Tensor

REDUCTIONS = ("batchmean", "sum", "mean", "none")

__all__ = [
    "IGNORE_INDEX",
    "REDUCTIONS",
    "default_chunk_rows",
    "generalized_jsd_loss",
    "jsd_rows",
    "jsd_rows_with_grads",
    "per_token_jsd",
]


def generalized_jsd_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "batchmean",
    logits_are_probs: bool = False,
    top_k: int | None = None,
    token_clip: float | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """Generalized JSD between student and teacher distributions (GKD, arXiv 2306.13649).

    Args:
        student_logits: (B, T, V) student logits (gradients flow here).
        teacher_logits: (B, T, V) teacher logits (gradients flow too if they require grad).
        labels: (B, T); positions equal to -100 are ignored. None keeps every position.
        beta: mixture weight in [0, 1]; ``m = beta*p_teacher + (1-beta)*p_student`` and
            ``JSD = beta*KL(teacher||m) + (1-beta)*KL(student||m)``; 0 is KL(teacher||student)
            and 1 is KL(student||teacher), as in trl's GKD.
        temperature: both logits are divided by it before the softmax.
        reduction: ``batchmean`` (sum / unmasked tokens with labels, sum / B without),
            ``sum``, ``mean`` (over all token x vocabulary terms), ``none`` -> (B, T).
        logits_are_probs: inputs are probabilities (rows summing to 1) instead of logits.
        top_k: restrict both distributions to the teacher's top-k tokens, renormalised.
        token_clip: clamp each token's divergence to at most this value (its gradient is
            then zero), which bounds the pull of outlier positions.
        chunk_size: tokens per chunk (default: about 16 MiB of fp32 per temporary).

    Returns:
        A scalar, or (B, T) for ``reduction="none"`` (0 at ignored positions).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not one of {REDUCTIONS}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student_logits {tuple(student_logits.shape)} and teacher_logits "
            f"{tuple(teacher_logits.shape)} must have the same shape"
        )
    if student_logits.dim() < 2:
        raise ValueError(f"logits must be (B, T, V) or (N, V), got {tuple(student_logits.shape)}")
    lead_shape = student_logits.shape[:-1]
    mask = None
    if labels is not None:
        if labels.shape != lead_shape:
            raise ValueError(
                f"labels {tuple(labels.shape)} must match the logits' leading shape "
                f"{tuple(lead_shape)}"
            )
        mask = labels != IGNORE_INDEX
    if token_clip is not None and not token_clip > 0:
        raise ValueError(f"token_clip={token_clip} must be > 0 (or None to disable)")

    if top_k is not None:
        student_logits, teacher_logits = _restrict_to_teacher_top_k(
            student_logits, teacher_logits, top_k, logits_are_probs
        )
        logits_are_probs = False
    vocab_terms = student_logits.shape[-1]

    per_token = per_token_jsd(
        student_logits,
        teacher_logits,
        mask,
        beta=beta,
        temperature=temperature,
        logits_are_probs=logits_are_probs,
        chunk_size=chunk_size,
    )
    if token_clip is not None:
        per_token = per_token.clamp(max=float(token_clip))

    if reduction == "none":
        return per_token
    total = per_token.sum()
    if reduction == "sum":
        return total
    n_tokens = per_token.numel() if mask is None else mask.sum()
    if reduction == "mean":
        if mask is None:
            return total / (n_tokens * vocab_terms)
        # trl: jsd[mask].mean() averages over every unmasked (token, vocab) term.
        return total / (n_tokens * vocab_terms)
    # batchmean
    if mask is None:
        return total / max(student_logits.shape[0], 1)
    return total / n_tokens.clamp_min(1)


def _restrict_to_teacher_top_k(
    student_logits: Tensor, teacher_logits: Tensor, top_k: int, logits_are_probs: bool
) -> tuple[Tensor, Tensor]:
    vocab = student_logits.shape[-1]
    if not 1 <= int(top_k) <= vocab:
        raise ValueError(f"top_k={top_k} must be in [1, V={vocab}]")
    top_idx = teacher_logits.detach().topk(int(top_k), dim=-1).indices
    s = student_logits.gather(-1, top_idx)
    t = teacher_logits.gather(-1, top_idx)
    if logits_are_probs:
        # log of the kept probabilities; the log_softmax downstream renormalises them.
        s = s.clamp_min(TINY_PROB).log()
        t = t.clamp_min(TINY_PROB).log()
    return s, t
