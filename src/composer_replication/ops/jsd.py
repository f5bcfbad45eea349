"""Generalized Jensen-Shannon divergence, the kernel of self-distillation (SDPO / OPSD).

The student is the policy on the plain context, the teacher the same (or a frozen) policy on
the hint-augmented context; both give a distribution over the vocabulary at every aligned
response position. This module computes the generalized JSD of Agarwal et al. (GKD,
arXiv 2306.13649, Eq. 1) with the conventions of trl's ``GKDTrainer.generalized_jsd_loss``
(beta=0 is forward KL(teacher||student), beta=1 is reverse KL(student||teacher), logits
divided by the temperature).

Both entry points work in chunks of tokens with an analytic gradient,

    m = beta * p_t + (1 - beta) * p_s
    dJ/dz_s = (1 - beta) / tau * p_s * (log p_s - log m - KL(p_s || m))
    dJ/dz_t = beta / tau * p_t * (log p_t - log m - KL(p_t || m))

- ``per_token_jsd``: from (..., V) logits (the ``opsd.generalized_jsd_loss`` face);
- ``jsd_from_hidden``: from hidden states and the head weight, never forming (B, T, V)
  logits (the path every trainer uses, through :mod:`.divergence`). Its matmuls follow the
  head's precision rule (:mod:`.head`): autocast's dtype under autocast, the head weights
  cast once per version; log-softmax, the divergence and the head-gradient sum in float32.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from composer_replication.ops.head import (
    add_matmul_,
    check_head,
    check_temperature,
    chunk_workspace,
    default_head_chunk_rows,
    head_matmul_dtype,
    head_weight_in,
    logits_into,
)

if TYPE_CHECKING:
    from torch import Tensor


# Rows of the vocabulary-sized matrices processed at once: 2**20 fp32 elements (4 MiB) per
# temporary keeps a chunk's intermediates in cache and under malloc's mmap threshold, so
# they are recycled instead of page-faulted in anew (measured fastest on a 2-core EPYC).
_CHUNK_ELEMENTS = 1 << 20


def default_chunk_rows(vocab_size: int) -> int:
    """Rows per chunk so that one (chunk, V) fp32 temporary is about 4 MiB."""
    return max(8, _CHUNK_ELEMENTS // max(vocab_size, 1))


# ---------------------------------------------------------------------------------------
# Row math: pure functions over log-probabilities of shape (C, V), already temperature-scaled.
# ---------------------------------------------------------------------------------------


def jsd_rows(student_logp: Tensor, teacher_logp: Tensor, beta: float) -> Tensor:
    """Per-row generalized JSD (C,) from student/teacher log-probabilities (C, V)."""
    if beta == 0.0:
        # Forward KL(teacher || student), trl's beta=0 convention.
        return (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)
    if beta == 1.0:
        # Reverse KL(student || teacher), trl's beta=1 convention.
        return (student_logp.exp() * (student_logp - teacher_logp)).sum(-1)
    mix_logp = _mixture_logp(student_logp, teacher_logp, beta)
    kl_student = (student_logp.exp() * (student_logp - mix_logp)).sum(-1)
    kl_teacher = (teacher_logp.exp() * (teacher_logp - mix_logp)).sum(-1)
    return beta * kl_teacher + (1.0 - beta) * kl_student


def jsd_rows_with_grads(
    student_logp: Tensor,
    teacher_logp: Tensor,
    beta: float,
    *,
    student_grad: bool = True,
    teacher_grad: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Per-row JSD (C,) and its gradients w.r.t. the temperature-scaled logits (C, V).

    The gradients are those of ``sum(jsd_rows(...))``; multiply by the upstream per-row
    gradient and divide by the temperature to get gradients w.r.t. raw logits.
    """
    p_s = student_logp.exp()
    p_t = teacher_logp.exp()
    grad_s = grad_t = None
    if beta == 0.0:
        log_ratio = teacher_logp - student_logp
        jsd = (p_t * log_ratio).sum(-1)
        if student_grad:
            grad_s = p_s - p_t
        if teacher_grad:
            grad_t = p_t * (log_ratio - jsd.unsqueeze(-1))
        return jsd, grad_s, grad_t
    if beta == 1.0:
        log_ratio = student_logp - teacher_logp
        jsd = (p_s * log_ratio).sum(-1)
        if student_grad:
            grad_s = p_s * (log_ratio - jsd.unsqueeze(-1))
        if teacher_grad:
            grad_t = p_t - p_s
        return jsd, grad_s, grad_t
    mix_logp = _mixture_logp(student_logp, teacher_logp, beta)
    s_ratio = student_logp - mix_logp
    t_ratio = teacher_logp - mix_logp
    kl_student = (p_s * s_ratio).sum(-1)
    kl_teacher = (p_t * t_ratio).sum(-1)
    jsd = beta * kl_teacher + (1.0 - beta) * kl_student
    if student_grad:
        grad_s = (1.0 - beta) * p_s * (s_ratio - kl_student.unsqueeze(-1))
    if teacher_grad:
        grad_t = beta * p_t * (t_ratio - kl_teacher.unsqueeze(-1))
    return jsd, grad_s, grad_t


def jsd_rows_student_grad_(
    student_logp: Tensor, teacher_logp: Tensor, beta: float, mix: Tensor, scratch: Tensor
) -> tuple[Tensor, Tensor]:
    """In-place variant of :func:`jsd_rows_with_grads` for the student side only.

    Destroys ``student_logp`` and ``teacher_logp`` and uses the two same-shaped ``mix`` and
    ``scratch`` buffers, so a chunk needs no temporaries beyond these four (C, V) buffers.
    Returns ``(jsd (C,), grad_student (C, V))``, the gradient living in ``student_logp``'s
    storage.
    """
    s, t = student_logp, teacher_logp
    if beta == 0.0:  # J = sum p_t (t - s); dJ/dz_s = p_s - p_t
        torch.exp(t, out=scratch)
        torch.sub(t, s, out=mix)
        jsd = mix.mul_(scratch).sum(-1)
        return jsd, s.exp_().sub_(scratch)
    if beta == 1.0:  # J = sum p_s (s - t); dJ/dz_s = p_s (s - t - J)
        torch.exp(s, out=scratch)
        s.sub_(t)
        jsd = torch.mul(scratch, s, out=mix).sum(-1)
        return jsd, s.sub_(jsd.unsqueeze(-1)).mul_(scratch)
    log_1mb, log_b = math.log1p(-beta), math.log(beta)
    torch.logaddexp(s.add_(log_1mb), t.add_(log_b), out=mix)  # log m
    s.sub_(log_1mb)
    t.sub_(log_b)
    torch.exp(t, out=scratch)
    kl_teacher = t.sub_(mix).mul_(scratch).sum(-1)
    torch.exp(s, out=scratch)
    s.sub_(mix)
    kl_student = torch.mul(scratch, s, out=mix).sum(-1)
    jsd = beta * kl_teacher + (1.0 - beta) * kl_student
    grad = s.sub_(kl_student.unsqueeze(-1)).mul_(scratch).mul_(1.0 - beta)
    return jsd, grad


def log_softmax_(logits: Tensor, scratch: Tensor) -> Tensor:
    """Row-wise log_softmax of ``logits`` (C, V) in place, using ``scratch`` as workspace."""
    logits.sub_(logits.amax(dim=-1, keepdim=True))
    lse = torch.exp(logits, out=scratch).sum(dim=-1, keepdim=True).log_()
    return logits.sub_(lse)


def _mixture_logp(student_logp: Tensor, teacher_logp: Tensor, beta: float) -> Tensor:
    # log(beta * p_t + (1 - beta) * p_s), stable even where both probabilities underflow.
    return torch.logaddexp(student_logp + math.log1p(-beta), teacher_logp + math.log(beta))


# ---------------------------------------------------------------------------------------
# Chunked per-token JSD over rows of logits, with an analytic backward pass.
# ---------------------------------------------------------------------------------------


class _ChunkedTokenJSD(torch.autograd.Function):
    """Per-token JSD (M,) over selected rows of (N, V) logits, chunk by chunk.

    When an input needs a gradient, the forward pass writes d(JSD_row)/d(logits) into one
    input-sized buffer per such input while the chunk is still in cache; the backward pass
    only scales those rows by the upstream gradient (in place, so no second buffer). A
    second backward through the same graph (``retain_graph=True``) recomputes instead.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        student_rows: Tensor,
        teacher_rows: Tensor,
        row_index: Tensor,
        beta: float,
        temperature: float,
        chunk_rows: int,
        from_probs: bool,
    ) -> Tensor:
        need_s, need_t = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        out = torch.empty(
            row_index.numel(), dtype=_compute_dtype(student_rows), device=student_rows.device
        )
        grad_s = _grad_buffer(student_rows, row_index) if need_s else None
        grad_t = _grad_buffer(teacher_rows, row_index) if need_t else None
        for start in range(0, row_index.numel(), chunk_rows):
            idx = row_index[start : start + chunk_rows]
            jsd, g_s, g_t = _chunk_jsd_and_grads(
                student_rows, teacher_rows, idx, beta, temperature, from_probs, need_s, need_t
            )
            out[start : start + idx.numel()] = jsd
            if need_s:
                grad_s.index_copy_(0, idx, g_s.to(grad_s.dtype))
            if need_t:
                grad_t.index_copy_(0, idx, g_t.to(grad_t.dtype))
        ctx.save_for_backward(student_rows, teacher_rows, row_index)
        ctx.settings = (beta, temperature, chunk_rows, from_probs)
        ctx.grads = [grad_s, grad_t]
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        student_rows, teacher_rows, row_index = ctx.saved_tensors
        beta, temperature, chunk_rows, from_probs = ctx.settings
        grads = ctx.grads
        if grads is None:  # a second backward: the buffers were consumed, recompute them
            grads = [
                _grad_buffer(student_rows, row_index) if ctx.needs_input_grad[0] else None,
                _grad_buffer(teacher_rows, row_index) if ctx.needs_input_grad[1] else None,
            ]
            for start in range(0, row_index.numel(), chunk_rows):
                idx = row_index[start : start + chunk_rows]
                _, g_s, g_t = _chunk_jsd_and_grads(
                    student_rows,
                    teacher_rows,
                    idx,
                    beta,
                    temperature,
                    from_probs,
                    grads[0] is not None,
                    grads[1] is not None,
                )
                for buf, g in zip(grads, (g_s, g_t)):
                    if buf is not None:
                        buf.index_copy_(0, idx, g.to(buf.dtype))
        ctx.grads = None
        scale = torch.zeros(student_rows.shape[0], dtype=grad_out.dtype, device=grad_out.device)
        scale.index_copy_(0, row_index, grad_out)
        scale = scale.unsqueeze(-1)
        for start in range(0, scale.shape[0], chunk_rows):  # in place, chunk by chunk
            for buf in grads:
                if buf is not None:
                    buf[start : start + chunk_rows].mul_(scale[start : start + chunk_rows])
        return grads[0], grads[1], None, None, None, None, None


def _grad_buffer(rows: Tensor, row_index: Tensor) -> Tensor:
    # Rows outside row_index get no gradient; zero only them (the rest is overwritten).
    buf = torch.empty_like(rows)
    if row_index.numel() != rows.shape[0]:
        keep = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
        keep[row_index] = False
        buf[keep] = 0
    return buf


def _chunk_jsd_and_grads(
    student_rows: Tensor,
    teacher_rows: Tensor,
    idx: Tensor,
    beta: float,
    temperature: float,
    from_probs: bool,
    need_s: bool,
    need_t: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """JSD of a chunk and its gradients w.r.t. the raw input rows (logits or probs)."""
    s_logp, t_logp = _chunk_logps(student_rows, teacher_rows, idx, temperature, from_probs)
    if not (need_s or need_t):
        return jsd_rows(s_logp, t_logp, beta), None, None
    jsd, g_s, g_t = jsd_rows_with_grads(
        s_logp, t_logp, beta, student_grad=need_s, teacher_grad=need_t
    )
    if temperature != 1.0:
        g_s = g_s / temperature if g_s is not None else None
        g_t = g_t / temperature if g_t is not None else None
    if from_probs:  # d log(p) / dp = 1 / p
        if g_s is not None:
            g_s = g_s / student_rows.index_select(0, idx).to(g_s.dtype).clamp_min(TINY_PROB)
        if g_t is not None:
            g_t = g_t / teacher_rows.index_select(0, idx).to(g_t.dtype).clamp_min(TINY_PROB)
    return jsd, g_s, g_t


# Smallest positive fp32: the floor under probabilities before a log.
TINY_PROB = torch.finfo(torch.float32).tiny


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _chunk_logps(
    student_rows: Tensor, teacher_rows: Tensor, idx: Tensor, temperature: float, from_probs: bool
) -> tuple[Tensor, Tensor]:
    dtype = _compute_dtype(student_rows)
    s = student_rows.index_select(0, idx).to(dtype)
    t = teacher_rows.index_select(0, idx).to(dtype)
    if from_probs:
        s = s.clamp_min(TINY_PROB).log()
        t = t.clamp_min(TINY_PROB).log()
    if temperature != 1.0:
        s = s / temperature
        t = t / temperature
    return torch.log_softmax(s, dim=-1), torch.log_softmax(t, dim=-1)


def per_token_jsd(
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    logits_are_probs: bool = False,
    chunk_size: int | None = None,
) -> Tensor:
    """Per-token generalized JSD (...,) of (..., V) logits, 0 where ``mask`` is False.

    Computed chunk by chunk with an analytic backward pass; never holds more than one
    (..., V) buffer (the gradient) beyond O(chunk_size * V) temporaries.
    """
    _check_beta_temperature(beta, temperature)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student_logits {tuple(student_logits.shape)} and teacher_logits "
            f"{tuple(teacher_logits.shape)} must have the same shape"
        )
    lead_shape = student_logits.shape[:-1]
    vocab = student_logits.shape[-1]
    s_rows = student_logits.reshape(-1, vocab)
    t_rows = teacher_logits.reshape(-1, vocab)
    if mask is None:
        row_index = torch.arange(s_rows.shape[0], device=s_rows.device)
    else:
        if mask.shape != lead_shape:
            raise ValueError(f"mask {tuple(mask.shape)} must have shape {tuple(lead_shape)}")
        row_index = mask.reshape(-1).nonzero().squeeze(-1)
    chunk = chunk_size or default_chunk_rows(vocab)
    values = _ChunkedTokenJSD.apply(
        s_rows,
        t_rows,
        row_index,
        float(beta),
        float(temperature),
        int(chunk),
        bool(logits_are_probs),
    )
    full = values.new_zeros(s_rows.shape[0])
    full = full.index_put((row_index,), values)
    return full.reshape(lead_shape)


def _check_beta_temperature(beta: float, temperature: float) -> None:
    if not 0.0 <= float(beta) <= 1.0:
        raise ValueError(f"beta={beta} must be in [0, 1] (0: KL(teacher||student), 1: reverse)")
    if not float(temperature) > 0.0:
        raise ValueError(f"temperature={temperature} must be > 0")


class _ChunkedHiddenJSD(torch.autograd.Function):
    """Per-token JSD (M,) between student rows (grad) and teacher rows (no grad).

    As for log-probs, the hidden-state gradient factor ``G @ W`` (G = dJSD/dz per row) is
    formed in the forward pass; the head's gradient recomputes the chunk's logits. Each
    chunk works in four re-used (C, V) buffers and allocates nothing else of that size.

    ``matmul_dtype`` (:func:`~.head.head_matmul_dtype`, chosen by the caller) is the dtype
    of the matmuls; both heads are cast to it once per version (:func:`~.head.head_weight_in`).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        student_hidden: Tensor,
        weight: Tensor,
        teacher_hidden: Tensor,
        teacher_weight: Tensor,
        beta: float,
        temperature: float,
        chunk: int,
        matmul_dtype: torch.dtype,
    ) -> Tensor:
        need_h = ctx.needs_input_grad[0]
        n_rows = student_hidden.shape[0]
        mm_weight = head_weight_in(weight, matmul_dtype)
        mm_teacher = head_weight_in(teacher_weight, matmul_dtype)
        bufs = [chunk_workspace(n_rows, chunk, weight) for _ in range(4)]
        out = torch.empty(n_rows, dtype=bufs[0].dtype, device=student_hidden.device)
        hidden_factor = torch.empty_like(student_hidden) if need_h else None
        sides = (student_hidden, mm_weight, teacher_hidden, mm_teacher)
        for start in range(0, n_rows, chunk):
            stop = min(start + chunk, n_rows)
            s_logp, t_logp, mix, scratch = _jsd_chunk_logps(bufs, start, stop, sides, temperature)
            if need_h:
                jsd, grad_logits = jsd_rows_student_grad_(s_logp, t_logp, beta, mix, scratch)
                hidden_factor[start:stop] = grad_logits.to(mm_weight.dtype) @ mm_weight
            else:
                jsd = jsd_rows(s_logp, t_logp, beta)
            out[start:stop] = jsd
        ctx.save_for_backward(
            student_hidden, weight, mm_weight, teacher_hidden, mm_teacher, hidden_factor
        )
        ctx.settings = (beta, temperature, chunk)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        student_hidden, weight, mm_weight, teacher_hidden, mm_teacher, hidden_factor = (
            ctx.saved_tensors
        )
        beta, temperature, chunk = ctx.settings
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        scaled = grad_out / temperature
        grad_h = hidden_factor * scaled[:, None].to(hidden_factor.dtype) if need_h else None
        grad_w = None
        if need_w:
            grad_w = torch.zeros_like(weight)
            n_rows = student_hidden.shape[0]
            bufs = [chunk_workspace(n_rows, chunk, weight) for _ in range(4)]
            sides = (student_hidden, mm_weight, teacher_hidden, mm_teacher)
            for start in range(0, n_rows, chunk):
                stop = min(start + chunk, n_rows)
                h = student_hidden[start:stop].to(mm_weight.dtype)
                s_logp, t_logp, mix, scratch = _jsd_chunk_logps(
                    bufs, start, stop, sides, temperature
                )
                _, grad_logits = jsd_rows_student_grad_(s_logp, t_logp, beta, mix, scratch)
                grad_logits.mul_(scaled[start:stop, None].to(grad_logits.dtype))
                add_matmul_(grad_w, grad_logits.T.to(mm_weight.dtype), h)
        return grad_h, grad_w, None, None, None, None, None, None


def _jsd_chunk_logps(
    bufs: list[Tensor],
    start: int,
    stop: int,
    sides: tuple[Tensor, Tensor, Tensor, Tensor],
    temperature: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Rows ``start:stop`` of ``sides`` = (student hidden, head, teacher hidden, head; the
    heads in the matmul dtype):
    student and teacher log-probs in the first two of the four workspace buffers, and the
    other two (``mix``, ``scratch``) for the row math."""
    student_hidden, weight, teacher_hidden, teacher_weight = sides
    s_buf, t_buf, mix, scratch = (b[: stop - start] for b in bufs)
    s_logits = logits_into(s_buf, student_hidden[start:stop], weight, temperature)
    t_logits = logits_into(t_buf, teacher_hidden[start:stop], teacher_weight, temperature)
    return log_softmax_(s_logits, scratch), log_softmax_(t_logits, scratch), mix, scratch


def teacher_head(
    student_hidden: Tensor, weight: Tensor, teacher_hidden: Tensor, teacher_weight: Tensor | None
) -> Tensor:
    """Check that student and teacher rows align; the detached teacher head weight."""
    check_head(student_hidden, weight)
    if teacher_hidden.shape != student_hidden.shape:
        raise ValueError(
            f"teacher_hidden {tuple(teacher_hidden.shape)} must match student_hidden "
            f"{tuple(student_hidden.shape)} (align the response positions first)"
        )
    t_weight = (weight if teacher_weight is None else teacher_weight).detach()
    if t_weight.shape != weight.shape:
        raise ValueError(
            f"teacher_weight {tuple(t_weight.shape)} must match weight {tuple(weight.shape)}"
        )
    return t_weight


def jsd_from_hidden(
    student_hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor,
    *,
    teacher_weight: Tensor | None = None,
    mask: Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> Tensor:
    """Per-token generalized JSD (...) between student and teacher heads (GKD conventions).

    The teacher side (``teacher_hidden``, ``teacher_weight``, default ``weight``) never
    receives gradient: it is the stop-gradient target of self-distillation. Positions where
    ``mask`` is False give 0. ``beta`` and ``temperature`` as in
    :func:`composer_replication.opsd.generalized_jsd_loss`. Under ``torch.autocast`` the
    matmuls run in autocast's dtype (each head cast once per version), the log-softmax and
    the divergence in float32.
    """
    check_temperature(temperature)
    if not 0.0 <= float(beta) <= 1.0:
        raise ValueError(f"beta={beta} must be in [0, 1]")
    t_weight = teacher_head(student_hidden, weight, teacher_hidden, teacher_weight)
    matmul_dtype = head_matmul_dtype(weight)
    lead = student_hidden.shape[:-1]
    flat_s = student_hidden.reshape(-1, student_hidden.shape[-1])
    flat_t = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])
    rows = None
    if mask is not None:
        if mask.shape != lead:
            raise ValueError(f"mask {tuple(mask.shape)} must have shape {tuple(lead)}")
        rows = mask.reshape(-1).bool().nonzero().squeeze(-1)
        flat_s = flat_s.index_select(0, rows)
        flat_t = flat_t.index_select(0, rows)
    chunk = chunk_size or default_head_chunk_rows(weight.shape[0])
    values = _ChunkedHiddenJSD.apply(
        flat_s,
        weight,
        flat_t,
        t_weight,
        float(beta),
        float(temperature),
        int(chunk),
        matmul_dtype,
    )
    if rows is not None:
        values = values.new_zeros(mask.numel()).index_put((rows,), values)
    return values.reshape(lead)
