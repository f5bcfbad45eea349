"""Per-token divergences between a student and a teacher distribution: the one place where
the self-distillation channel's math lives.

Three kinds, selected by :class:`DivergenceSettings` ``kind``:

- ``"jsd"``: the generalized JSD of GKD (arXiv 2306.13649), mixture ``beta``
  (:mod:`.jsd`, analytic chunked gradient); with ``top_k``, over the teacher's top-k
  tokens plus one tail bucket holding the rest of each distribution's mass (SDPO, arXiv
  2601.20802; ``topk_tail_jsd_token_loss``);
- ``"taid"``: TAID (arXiv 2501.16937), cross-entropy of the student to the target
  ``softmax((1 - t) * stopgrad(z_s) + t * z_t)``;
- ``"entropy_opd"``: entropy-aware on-policy distillation (arXiv 2603.07079),
  ``w * KL(teacher || student) + (1 - w) * KL(student || teacher)`` with
  ``w = clamp(H(teacher) / h_max, 0, 1)``.

All kinds divide both logits by ``temperature`` first and clamp each token's value at
``token_clip`` when it is set. The logits functions (``taid_token_loss``,
``entropy_opd_token_loss``) work on (..., V) logits and back the seed-API faces in
:mod:`composer_replication.distillation`; :func:`token_divergence` applies the chosen kind
to hidden-state rows and the LM head chunk by chunk, so no caller ever holds (M, V) logits
for more than ``chunk_size`` rows at a time (TAID and entropy-aware OPD recompute a chunk's
logits in the backward pass instead of keeping them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from composer_replication.config.loss import DIVERGENCE_KNOBS
from composer_replication.ops.head import default_head_chunk_rows
from composer_replication.ops.jsd import jsd_from_hidden, teacher_head

if TYPE_CHECKING:
    from torch import Tensor

DIVERGENCES = ("jsd", "taid", "entropy_opd")
#: The public ``sdpo_wrapper`` names of the kinds.
SDPO_WRAPPERS = {"none": "jsd", "taid": "taid", "entropy_opd": "entropy_opd"}

__all__ = [
    "DIVERGENCES",
    "DIVERGENCE_KNOBS",
    "SDPO_WRAPPERS",
    "DivergenceSettings",
    "divergence_settings",
    "entropy_opd_token_loss",
    "finite_logprobs",
    "taid_token_loss",
    "token_divergence",
    "topk_tail_jsd_token_loss",
]


@dataclass(frozen=True)
class DivergenceSettings:
    """How the self-distillation channel compares student and teacher at one token.

    Attributes:
        kind: ``"jsd"``, ``"taid"`` or ``"entropy_opd"``.
        beta: the JSD mixture in [0, 1] (0 forward KL, 1 reverse KL); jsd only.
        temperature: both logits are divided by it (> 0).
        token_clip: clamp each token's value to at most this (> 0); None: no clamp.
        taid_t: TAID's interpolation in [0, 1] (required for ``"taid"``).
        h_max: entropy at which entropy-aware OPD's weight reaches 1 (None: log V).
        chunk_size: hidden rows per chunk (None: about 32 MiB of fp32 logits).
        top_k: jsd over the teacher's top-k tokens and a tail bucket (None: all of V).
    """

    kind: str = "jsd"
    beta: float = 0.5
    temperature: float = 1.0
    token_clip: float | None = None
    taid_t: float | None = None
    h_max: float | None = None
    chunk_size: int | None = None
    top_k: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in DIVERGENCES:
            raise ValueError(f"divergence kind {self.kind!r} is not one of {DIVERGENCES}")
        if not 0.0 <= float(self.beta) <= 1.0:
            raise ValueError(f"sdpo_jsd_beta={self.beta} must be in [0, 1]")
        if not float(self.temperature) > 0.0:
            raise ValueError(f"sdpo_temperature={self.temperature} must be > 0")
        if self.token_clip is not None and not float(self.token_clip) > 0.0:
            raise ValueError(f"sdpo_token_clip={self.token_clip} must be > 0 (or None: no clamp)")
        if self.kind == "taid":
            if self.taid_t is None:
                raise ValueError(
                    "sdpo_wrapper='taid' needs taid_t in [0, 1] (a number, or the t of a "
                    "TAIDScheduler)"
                )
            if not 0.0 <= float(self.taid_t) <= 1.0:
                raise ValueError(f"taid_t={self.taid_t} must be in [0, 1]")
        if self.h_max is not None and not float(self.h_max) > 0.0:
            raise ValueError(f"entropy_opd_h_max={self.h_max} must be > 0 (or None: log V)")
        if self.chunk_size is not None and int(self.chunk_size) < 1:
            raise ValueError(f"chunk_size={self.chunk_size} must be >= 1")
        if self.top_k is not None:
            if int(self.top_k) < 1:
                raise ValueError(f"sdpo_top_k={self.top_k} must be >= 1 (or None: all of V)")
            if self.kind != "jsd":
                raise ValueError(
                    f"sdpo_top_k={self.top_k} works with the generalized JSD only; unset it "
                    f"or set sdpo_wrapper = 'none' (not {self.kind!r})"
                )


def divergence_settings(
    *,
    sdpo_jsd_beta: float = 0.5,
    sdpo_temperature: float = 1.0,
    sdpo_token_clip: float | None = None,
    sdpo_wrapper: str = "none",
    taid_t: Any = None,
    entropy_opd_h_max: float | None = None,
    chunk_size: int | None = None,
    top_k: int | None = None,
) -> DivergenceSettings:
    """The SDPO channel's settings from its public knob names (:data:`DIVERGENCE_KNOBS`).

    ``taid_t`` is a number in [0, 1] or an object with a ``t`` attribute (a
    ``distillation.TAIDScheduler``), read at call time.
    """
    if sdpo_wrapper not in SDPO_WRAPPERS:
        raise ValueError(
            f"sdpo_wrapper={sdpo_wrapper!r} is not one of {tuple(SDPO_WRAPPERS)} ('none' is the "
            "generalized JSD)"
        )
    t = getattr(taid_t, "t", taid_t)
    return DivergenceSettings(
        kind=SDPO_WRAPPERS[sdpo_wrapper],
        beta=sdpo_jsd_beta,
        temperature=sdpo_temperature,
        token_clip=sdpo_token_clip,
        taid_t=None if t is None else float(t),
        h_max=entropy_opd_h_max,
        chunk_size=chunk_size,
        top_k=top_k,
    )


def finite_logprobs(log_probs: Tensor) -> Tensor:
    """``-inf`` log-probs replaced by the dtype's lowest finite value (gradient 0 there)."""
    return log_probs.clamp(min=torch.finfo(log_probs.dtype).min)


def token_mask(
    mask: Tensor | None, shape: torch.Size, device: torch.device, *, where: str, name: str
) -> Tensor:
    """A (B, T) bool mask from ``None`` (all tokens), a bool mask or a 0/1 mask; ``where``
    and ``name`` (the caller and its argument) go into the error of a bad one."""
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if mask.shape != shape:
        raise ValueError(
            f"{where}: {name} shape {tuple(mask.shape)} must be (B, T) = {tuple(shape)}"
        )
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(
            f"{where}: {name} must be a bool or 0/1 mask; for token ids with -100 pass "
            "`labels != -100`"
        )
    return mask != 0


def _compute_dtype(a: Tensor, b: Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)


def taid_token_loss(student_logits: Tensor, teacher_logits: Tensor, t: float) -> Tensor:
    """Per-token TAID loss (...,): ``-sum_v p_t(v) * log q(v)`` (arXiv 2501.16937).

    ``p_t = softmax((1 - t) * stopgrad(student_logits) + t * teacher_logits)`` and ``q`` the
    student's softmax. Runs in float32 at least; vocabulary entries whose student logit is
    infinite contribute 0. At ``t = 0`` and ``t = 1`` the zero-weighted side is dropped, so
    a ``-inf`` logit is never multiplied by 0.
    """
    dtype = _compute_dtype(student_logits, teacher_logits)
    student = student_logits.to(dtype)
    teacher = teacher_logits.to(dtype)
    if t == 0.0:
        mixed = student.detach()
    elif t == 1.0:
        mixed = teacher
    else:
        mixed = (1.0 - t) * student.detach() + t * teacher
    target = torch.softmax(mixed, dim=-1)
    # The clamp keeps -inf out of the product so the backward pass stays NaN-free.
    log_q = torch.log_softmax(student, dim=-1).clamp(min=torch.finfo(dtype).min)
    return -(target * log_q).masked_fill(torch.isinf(student), 0.0).sum(dim=-1)


def entropy_opd_token_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    *,
    h_max: float | None = None,
    temperature: float = 1.0,
) -> Tensor:
    """Per-token entropy-aware OPD loss (...,) (arXiv 2603.07079).

    ``w * KL(p || q) + (1 - w) * KL(q || p)`` with ``p`` the tempered teacher, ``q`` the
    tempered student and ``w = clamp(H(p) / h_max, 0, 1)`` (no gradient; ``h_max`` defaults
    to ``log V``). Runs in float32 at least.
    """
    vocab = student_logits.shape[-1]
    if h_max is None:
        if vocab < 2:
            raise ValueError(f"V={vocab} makes the default h_max = log V = 0; pass h_max > 0")
        h_max = math.log(vocab)
    dtype = _compute_dtype(student_logits, teacher_logits)
    log_q = torch.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    log_p = torch.log_softmax(teacher_logits.to(dtype) / temperature, dim=-1)
    with torch.no_grad():
        entropy = -(log_p.exp() * finite_logprobs(log_p)).sum(dim=-1)
        weight = (entropy / h_max).clamp(0.0, 1.0)
    # Finite stand-ins for -inf keep inf - inf = NaN out of both passes.
    safe_q, safe_p = finite_logprobs(log_q), finite_logprobs(log_p)
    forward_kl = (log_p.exp() * (safe_p - safe_q)).sum(dim=-1)
    reverse_kl = (log_q.exp() * (safe_q - safe_p)).sum(dim=-1)
    return weight * forward_kl + (1.0 - weight) * reverse_kl


def topk_tail_jsd_token_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    *,
    top_k: int,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> Tensor:
    """Per-token generalized JSD (...,) over k + 1 buckets: the teacher's top-k tokens and
    one tail bucket holding the rest of each distribution's mass (SDPO, arXiv 2601.20802).

    Both logits are divided by ``temperature``; the top-k is picked on the teacher (no
    gradient). Unlike a renormalised top-k, the tail keeps the student's mass outside the
    teacher's top tokens in the comparison. ``top_k >= V`` is the full-vocabulary JSD.
    """
    from composer_replication.ops.jsd import jsd_rows

    vocab = student_logits.shape[-1]
    dtype = _compute_dtype(student_logits, teacher_logits)
    log_q = torch.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    log_p = torch.log_softmax(teacher_logits.to(dtype) / temperature, dim=-1).detach()
    if top_k >= vocab:
        return jsd_rows(finite_logprobs(log_q), finite_logprobs(log_p), float(beta))
    top = log_p.topk(int(top_k), dim=-1).indices
    in_top = torch.zeros_like(log_p, dtype=torch.bool).scatter_(-1, top, True)

    def buckets(logp: Tensor) -> Tensor:
        tail = logp.masked_fill(in_top, float("-inf")).logsumexp(dim=-1, keepdim=True)
        return finite_logprobs(torch.cat([logp.gather(-1, top), tail], dim=-1))

    return jsd_rows(buckets(log_q), buckets(log_p), float(beta))


def _logits_divergence(
    student_logits: Tensor, teacher_logits: Tensor, settings: DivergenceSettings
) -> Tensor:
    if settings.kind == "jsd":
        return topk_tail_jsd_token_loss(
            student_logits,
            teacher_logits,
            top_k=int(settings.top_k or student_logits.shape[-1]),
            beta=settings.beta,
            temperature=settings.temperature,
        )
    if settings.kind == "taid":
        tau = float(settings.temperature)
        return taid_token_loss(student_logits / tau, teacher_logits / tau, float(settings.taid_t))
    return entropy_opd_token_loss(
        student_logits, teacher_logits, h_max=settings.h_max, temperature=settings.temperature
    )


def _chunked_logits_divergence(
    student_hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    settings: DivergenceSettings,
) -> Tensor:
    """TAID / entropy-aware OPD / top-k JSD over hidden rows, chunk by chunk.

    With grad, each chunk runs under non-reentrant activation checkpointing: its (C, V)
    logits are dropped after the forward pass and recomputed in the backward pass.
    """
    from torch.utils.checkpoint import checkpoint

    t_weight = teacher_weight.detach()

    def chunk_values(h_s: Tensor, h_t: Tensor) -> Tensor:
        s_logits = h_s @ weight.T
        with torch.no_grad():
            t_logits = h_t @ t_weight.T
        return _logits_divergence(s_logits, t_logits, settings)

    chunk = settings.chunk_size or default_head_chunk_rows(weight.shape[0])
    grad = torch.is_grad_enabled() and (student_hidden.requires_grad or weight.requires_grad)
    out = []
    for start in range(0, student_hidden.shape[0], chunk):
        h_s = student_hidden[start : start + chunk]
        h_t = teacher_hidden[start : start + chunk].detach()
        if grad:
            out.append(checkpoint(chunk_values, h_s, h_t, use_reentrant=False))
        else:
            out.append(chunk_values(h_s, h_t))
    if not out:
        return student_hidden.new_zeros(0, dtype=_compute_dtype(student_hidden, weight))
    return torch.cat(out)


def token_divergence(
    student_hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor | None = None,
    settings: DivergenceSettings | None = None,
) -> Tensor:
    """Per-token divergence (M,) between student rows (grad) and teacher rows (no grad).

    Args:
        student_hidden: (M, H) final hidden states that predict the distilled tokens in the
            student context.
        weight: (V, H) the student's LM-head weight.
        teacher_hidden: (M, H) the teacher's hidden states at the aligned positions.
        teacher_weight: (V, H) the teacher's head weight (default: ``weight``, detached).
        settings: which divergence and its knobs (default: JSD at beta 0.5).

    Returns:
        (M,) per-token values, clamped at ``settings.token_clip`` when it is set.
    """
    cfg = settings or DivergenceSettings()
    t_weight = teacher_head(student_hidden, weight, teacher_hidden, teacher_weight)
    if cfg.kind == "jsd" and cfg.top_k is None:
        values = jsd_from_hidden(
            student_hidden,
            weight,
            teacher_hidden,
            teacher_weight=t_weight,
            beta=cfg.beta,
            temperature=cfg.temperature,
            chunk_size=cfg.chunk_size,
        )
    else:
        values = _chunked_logits_divergence(student_hidden, weight, teacher_hidden, t_weight, cfg)
    if cfg.token_clip is not None:
        values = values.clamp(max=float(cfg.token_clip))
    return values
