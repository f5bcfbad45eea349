"""TAID: distil toward a teacher interpolated, in logit space, with the detached student.

TAID, Temporally Adaptive Interpolated Distillation (Shing et al.; arXiv 2501.16937, ICLR 2025),
replaces the fixed teacher target with an intermediate one

    p_t = softmax((1 - t) * stopgrad(student_logits) + t * teacher_logits)

and minimises the cross-entropy ``-sum_v p_t(v) log q(v)`` of the student ``q`` to it. ``t``
starts well below 1 (the target sits just ahead of the student, which helps when the capacity
gap is large) and rises to 1 (plain forward-KL distillation). :class:`TAIDScheduler` moves ``t``
along a linear floor plus an adaptive bump that grows while the loss is falling.

Both pieces follow the reference implementation (github.com/SakanaAI/TAID, ``src/distil_losses``):
``taid_loss`` is its ``compute_loss`` plus ``forward_kl``, and ``TAIDScheduler.update_t`` is its
``update_t``, which returns the proposed step ``delta_t`` as upstream does (the new ``t`` is the
``t`` property). The few differences (empty masks, non-finite losses, steps past the end of
training, the scheduler's float64 state) are listed where they occur.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from composer_replication.ops.divergence import taid_token_loss, token_mask


def taid_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Tensor | None = None,
    *,
    t: float | Tensor,
) -> Tensor:
    """TAID loss: cross-entropy of the student to the interpolated target (arXiv 2501.16937).

    ``loss = -(1 / N) * sum_{masked (b, s)} sum_v p_t[b, s, v] * log_softmax(student)[b, s, v]``

    where ``p_t = softmax((1 - t) * stopgrad(student_logits) + t * teacher_logits)`` over the
    vocabulary and ``N`` is the number of masked tokens. Because ``p_t`` carries no gradient
    to the student, this has the same student gradient as ``KL(p_t || q)``:
    ``d loss / d student_logits[b, s] = (softmax(student)[b, s] - p_t[b, s]) / N``.

    Computation runs in float32 at least (float64 inputs stay float64), like upstream. Vocabulary
    entries whose student logit is infinite (e.g. ``-inf`` padding) contribute 0, as upstream.

    Args:
        student_logits: (B, T, V) student logits; the gradient flows here.
        teacher_logits: (B, T, V) teacher logits. Not detached (the formula's stop-gradient is on
            the student only); compute them under ``torch.no_grad()``.
        mask: (B, T) bool or 0/1; 1 marks a token that counts. ``None`` counts every token.
        t: interpolation weight in [0, 1], a Python number or a 0-d tensor (read as a constant).
            ``t = 1`` is cross-entropy to ``softmax(teacher_logits)``; ``t = 0`` targets the
            student's own (detached) distribution, whose gradient is identically zero.

    Returns:
        0-d tensor. If the mask selects no token, 0.0 that still has a ``grad_fn`` (gradient 0),
        where upstream would divide 0 by 0.

    Raises:
        ValueError: logits are not 3-D or differ in shape, the mask is not (B, T) or holds values
            other than 0/1, or ``t`` is not a scalar in [0, 1].
    """
    if student_logits.dim() != 3 or student_logits.shape != teacher_logits.shape:
        raise ValueError(
            "taid_loss: student_logits and teacher_logits must both be (B, T, V) with the same "
            f"shape, got {tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}"
        )
    t_value = _unit_interval_scalar(t)
    tokens = token_mask(
        mask, student_logits.shape[:2], student_logits.device, where="taid_loss", name="mask"
    )

    per_token = taid_token_loss(student_logits, teacher_logits, t_value)  # (B, T)
    total = torch.where(tokens, per_token, torch.zeros_like(per_token)).sum()
    return total / tokens.sum().clamp(min=1).to(per_token.dtype)


class TAIDScheduler:
    """The adaptive schedule for TAID's ``t`` (arXiv 2501.16937, "adaptive update of t").

    State: ``t`` (starts at ``t_start``), the previous loss (none at start) and a momentum
    (starts at 0), kept as Python floats, so ``t`` is exactly the number the formulas give
    (``t_start=0.1`` reads back as ``0.1``, not the float32 ``0.10000000149``). Each
    :meth:`update_t` with a finite loss ``L`` at step ``n`` after the first does::

        relative_change = (L_prev - L) / (L_prev + 1e-15)
        momentum        = beta * momentum + (1 - beta) * relative_change
        t_linear        = t_start + (t_end - t_start) * min(1, n / num_train_steps)
        delta_t         = alpha * sigmoid(momentum) * (1 - t)
        t               = min(t_end, max(t_linear, t + delta_t))
        L_prev          = L

    and returns ``delta_t``, as upstream does. ``delta_t >= 0`` so ``t`` never decreases, it
    never falls below the linear floor, and never exceeds ``t_end``. With
    ``disable_adaptive=True`` the update is ``t = min(t_end, max(t, t_linear))``: exactly the
    linear schedule whenever ``global_step`` does not go backwards (upstream sets
    ``t = t_linear`` outright; the ``max`` keeps ``t`` monotone if a step is replayed). The
    momentum and ``delta_t`` are still computed (and ``delta_t`` returned), as upstream.

    Deliberate differences from upstream: a non-finite loss is ignored (no state change; the
    first *finite* loss seeds); ``global_step / num_train_steps`` is capped at 1; the state is
    float64 (Python floats) rather than float32 buffers; the previous loss starts as ``None``
    rather than an ``inf`` sentinel; a previous loss of exactly ``-1e-15`` (a zero
    denominator) counts as no relative change instead of producing inf/NaN.

    Args:
        num_train_steps: total optimiser steps, >= 1; the linear floor reaches ``t_end`` here.
        t_start: initial ``t``, in [0, t_end].
        t_end: final and maximal ``t``, in [t_start, 1].
        alpha: scale of the adaptive step, >= 0 (0 gives the pure linear floor).
        beta: EMA coefficient of the momentum, in [0, 1).
        disable_adaptive: follow the linear floor only.
        device: where the tensor :meth:`update_t` returns lives.

    Raises:
        ValueError: any argument outside the ranges above.
    """

    def __init__(
        self,
        num_train_steps: int,
        *,
        t_start: float = 0.4,
        t_end: float = 1.0,
        alpha: float = 5e-4,
        beta: float = 0.99,
        disable_adaptive: bool = False,
        device: str | torch.device = "cpu",
    ) -> None:
        if isinstance(num_train_steps, bool) or int(num_train_steps) != num_train_steps:
            raise ValueError(
                f"TAIDScheduler: num_train_steps must be an int, got {num_train_steps}"
            )
        if num_train_steps < 1:
            raise ValueError(f"TAIDScheduler: num_train_steps must be >= 1, got {num_train_steps}")
        if not 0.0 <= t_start <= t_end <= 1.0:
            raise ValueError(
                "TAIDScheduler: need 0 <= t_start <= t_end <= 1, got "
                f"t_start={t_start}, t_end={t_end}"
            )
        if not alpha >= 0.0:
            raise ValueError(f"TAIDScheduler: alpha must be >= 0, got {alpha}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"TAIDScheduler: beta must be in [0, 1), got {beta}")
        self.num_train_steps = int(num_train_steps)
        self.t_start = float(t_start)
        self.t_end = float(t_end)
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.disable_adaptive = bool(disable_adaptive)
        self.device = torch.device(device)
        self._t = self.t_start
        self._prev_loss: float | None = None
        self._momentum = 0.0

    @property
    def t(self) -> float:
        """Current interpolation weight, a Python float (pass it to :func:`taid_loss`)."""
        return self._t

    def linear_t(self, global_step: int) -> float:
        """The linear floor ``t_start + (t_end - t_start) * min(1, global_step / num_train_steps)``."""
        progress = min(1.0, global_step / self.num_train_steps)
        return self.t_start + (self.t_end - self.t_start) * progress

    def update_t(self, loss: Tensor | float, global_step: int) -> Tensor | None:
        """Advance ``t`` after a step with this (detached) loss; see the class docstring.

        Args:
            loss: the TAID loss of the step just taken, a scalar (0-d or 1-element) tensor or
                a Python number. It is detached and read as a Python float.
            global_step: optimiser steps completed so far, >= 0.

        Returns:
            ``delta_t = alpha * sigmoid(momentum) * (1 - t_before)``, the adaptive step this
            update proposed, as upstream TAID's ``update_t`` returns it: a 0-d float32 tensor
            on ``device``. It is not always ``t_after - t_before``: the linear floor may lift
            ``t`` further, ``t_end`` may cap it, and with ``disable_adaptive`` it is not
            applied at all. Read the new value from :attr:`t`. ``None`` when the loss only
            seeded the previous loss (the first finite loss) or was ignored (NaN or inf).

        Raises:
            ValueError: ``loss`` has more than one element, or ``global_step < 0``.
        """
        if global_step < 0:
            raise ValueError(f"TAIDScheduler.update_t: global_step must be >= 0, got {global_step}")
        if isinstance(loss, Tensor):
            if loss.numel() != 1:
                raise ValueError(
                    "TAIDScheduler.update_t: loss must be a scalar, got shape "
                    f"{tuple(loss.shape)}; reduce it first"
                )
            current = float(loss.detach().reshape(()))
        else:
            current = float(loss)
        if not math.isfinite(current):
            return None
        if self._prev_loss is None:
            self._prev_loss = current
            return None

        denominator = self._prev_loss + 1e-15
        relative_change = (self._prev_loss - current) / denominator if denominator else 0.0
        self._momentum = self.beta * self._momentum + (1.0 - self.beta) * relative_change
        t_linear = self.linear_t(global_step)
        delta_t = self.alpha * _sigmoid(self._momentum) * (1.0 - self._t)
        if self.disable_adaptive:
            new_t = max(self._t, t_linear)
        else:
            new_t = max(t_linear, self._t + delta_t)
        self._t = min(new_t, self.t_end)
        self._prev_loss = current
        return torch.tensor(delta_t, dtype=torch.float32, device=self.device)

    def state_dict(self) -> dict[str, float | None]:
        """The mutable state as Python numbers: ``{"t", "prev_loss", "momentum"}``.

        The state is Python floats, so a restored scheduler continues bit-for-bit. The
        constructor arguments are not included.
        """
        return {"t": self._t, "prev_loss": self._prev_loss, "momentum": self._momentum}

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: a key is missing, or ``t`` is outside [0, t_end].
        """
        missing = {"t", "prev_loss", "momentum"} - set(state)
        if missing:
            raise ValueError(f"TAIDScheduler.load_state_dict: missing keys {sorted(missing)}")
        t = float(state["t"])  # type: ignore[arg-type]
        if not 0.0 <= t <= self.t_end:
            raise ValueError(
                f"TAIDScheduler.load_state_dict: t={t} is outside [0, t_end={self.t_end}]"
            )
        self._t = t
        prev = state["prev_loss"]
        self._prev_loss = None if prev is None else float(prev)
        self._momentum = float(state["momentum"])  # type: ignore[arg-type]


def _sigmoid(x: float) -> float:
    """Logistic function without overflow for large ``|x|``."""
    if x >= 0.0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def _unit_interval_scalar(t: float | Tensor) -> float:
    if isinstance(t, Tensor):
        if t.dim() != 0:
            raise ValueError(
                f"taid_loss: t must be a float or a 0-d tensor, got shape {tuple(t.shape)}"
            )
        value = float(t.detach())
    else:
        value = float(t)
    if not 0.0 <= value <= 1.0:  # also rejects NaN
        raise ValueError(f"taid_loss: t must be in [0, 1], got {value}")
    return value
