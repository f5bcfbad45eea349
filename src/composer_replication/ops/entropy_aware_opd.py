"""Entropy-aware on-policy distillation: mix forward and reverse KL by teacher entropy.

On-policy distillation usually minimises the reverse KL ``KL(student || teacher)`` on tokens the
student sampled. Reverse KL is mode-seeking: where the teacher is uncertain (high entropy) it
pushes the student onto one of the teacher's modes and collapses diversity. Entropy-Aware
On-Policy Distillation (Jin et al., "Entropy-Aware On-Policy Distillation of Language Models",
arXiv 2603.07079) adds the mode-covering forward KL on high-entropy tokens. This module uses a
soft per-token mix:

    w    = clamp(H(teacher) / h_max, 0, 1)            (no gradient; h_max defaults to log V)
    loss = w * KL(teacher || student) + (1 - w) * KL(student || teacher)

so a confident teacher (w ~ 0) gives plain reverse KL and a uniform teacher (w = 1) gives
forward KL.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from composer_replication.ops.divergence import entropy_opd_token_loss, finite_logprobs, token_mask

_REDUCTIONS = ("batchmean", "mean", "sum", "none")


def teacher_entropy(teacher_logits: Tensor) -> Tensor:
    """Entropy in nats of ``softmax(teacher_logits)`` over the last dimension.

    Computed from ``log_softmax`` (no ``log(softmax)`` underflow). ``-inf`` logits (masked
    vocabulary entries) contribute 0. Runs in float32 at least.

    Args:
        teacher_logits: (B, T, V) logits (any leading shape works).

    Returns:
        (B, T) ``-sum_v p(v) log p(v)``, between 0 and ``log V``.

    Raises:
        ValueError: ``teacher_logits`` is 0-d or has an empty vocabulary dimension.
    """
    if teacher_logits.dim() == 0 or teacher_logits.shape[-1] == 0:
        raise ValueError(
            "teacher_entropy: teacher_logits must be (..., V) with V >= 1, got shape "
            f"{tuple(teacher_logits.shape)}"
        )
    logits = teacher_logits.to(torch.promote_types(teacher_logits.dtype, torch.float32))
    log_p = torch.log_softmax(logits, dim=-1)
    return -(log_p.exp() * finite_logprobs(log_p)).sum(dim=-1)


def entropy_aware_opd_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    *,
    labels: Tensor | None = None,
    h_max: float | None = None,
    temperature: float = 1.0,
    reduction: str = "batchmean",
) -> Tensor:
    """Entropy-weighted mix of forward and reverse KL per token (after arXiv 2603.07079).

    Both logits are divided by ``temperature``; with ``p`` the teacher and ``q`` the student
    distribution at a token, the per-token loss is

        w * KL(p || q) + (1 - w) * KL(q || p),   w = clamp(H(p) / h_max, 0, 1)

    ``w`` (and ``H(p)``, on the tempered teacher) carries no gradient. ``labels`` masks tokens
    after mixing. Runs in float32 at least.

    Args:
        student_logits: (B, T, V) student logits; the gradient flows here.
        teacher_logits: (B, T, V) teacher logits. Not detached inside the KL terms; compute them
            under ``torch.no_grad()`` (or detach them) for a frozen teacher.
        labels: (B, T) bool or 0/1 mask, 1 = the token counts (e.g. the sampled response
            tokens). ``None`` counts every token.
        h_max: entropy at which the weight reaches 1, > 0; defaults to ``log V`` (the entropy of
            the uniform distribution).
        temperature: softmax temperature, > 0.
        reduction: ``"batchmean"`` (default) and ``"mean"`` both give the mean over counted
            tokens: masked sum / number of masked tokens, i.e. sum / (B*T) without ``labels``,
            and 0.0 (with a zero gradient) when no token is counted. Note this is a per-token
            mean, not torch ``kl_div``'s divide-by-B. ``"sum"``: masked sum. ``"none"``: (B, T)
            per-token losses with uncounted positions set to 0.

    Returns:
        0-d tensor, or (B, T) for ``reduction="none"``.

    Raises:
        ValueError: logits are not 3-D or differ in shape, ``labels`` is not (B, T) or holds
            values other than 0/1, ``h_max <= 0`` (or V = 1 with no ``h_max``),
            ``temperature <= 0``, or ``reduction`` is unknown.
    """
    if student_logits.dim() != 3 or student_logits.shape != teacher_logits.shape:
        raise ValueError(
            "entropy_aware_opd_loss: student_logits and teacher_logits must both be (B, T, V) "
            f"with the same shape, got {tuple(student_logits.shape)} and "
            f"{tuple(teacher_logits.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"entropy_aware_opd_loss: temperature must be > 0, got {temperature}")
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"entropy_aware_opd_loss: reduction must be one of {_REDUCTIONS}, got {reduction!r}"
        )
    vocab = student_logits.shape[-1]
    if h_max is None:
        if vocab < 2:
            raise ValueError(
                f"entropy_aware_opd_loss: V={vocab} makes the default h_max = log V = 0; "
                "pass h_max > 0"
            )
        h_max = math.log(vocab)
    if not h_max > 0:
        raise ValueError(f"entropy_aware_opd_loss: h_max must be > 0, got {h_max}")
    tokens = token_mask(
        labels,
        student_logits.shape[:2],
        student_logits.device,
        where="entropy_aware_opd_loss",
        name="labels",
    )

    per_token = entropy_opd_token_loss(
        student_logits, teacher_logits, h_max=h_max, temperature=temperature
    )
    per_token = torch.where(tokens, per_token, torch.zeros_like(per_token))

    if reduction == "none":
        return per_token
    total = per_token.sum()
    if reduction == "sum":
        return total
    return total / tokens.sum().clamp(min=1).to(per_token.dtype)
