"""Advantage math: pure functions from a group's rewards to per-rollout and per-token credit.

- ``grpo_advantages``: Dr.GRPO (arXiv 2503.20783) ``A = r - mean(r)``; with
  ``std_normalize`` the classic GRPO (arXiv 2402.03300) ``(r - mean) / (std + eps)``.
- ``max_rl_advantages``: MaxRL (arXiv 2602.02710) ``(r - mean) / (mean + eps)``.
- ``length_penalty``: a reward penalty for completions longer than a target.
- ``broadcast_to_tokens``: a rollout's scalar advantage onto its sampled tokens.
- ``align_prefill_logprobs``: a scorer's log-probs of a re-rendered context mapped back
  onto the positions of the sample they belong to.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def _as_group(rewards: Tensor | Sequence[float]) -> Tensor:
    r = torch.as_tensor(rewards, dtype=torch.float64, device="cpu")
    if r.dim() != 1:
        raise ValueError(f"rewards must be one group of shape (G,), got {tuple(r.shape)}")
    if r.numel() and not bool(torch.isfinite(r).all()):
        raise ValueError(f"rewards must be finite, got {r.tolist()}")
    return r


def grpo_advantages(
    rewards: Tensor | Sequence[float], *, std_normalize: bool = False, eps: float = 1e-6
) -> Tensor:
    """(G,) group-relative advantages of one group's rewards (G,).

    Default (Dr.GRPO, arXiv 2503.20783): ``A_i = r_i - mean(r)`` with no std division and
    no length normalisation. ``std_normalize=True`` gives classic GRPO (arXiv 2402.03300):
    ``A_i = (r_i - mean(r)) / (std(r) + eps)`` with the SAMPLE standard deviation (Bessel's
    correction, n - 1), exactly as trl's ``GRPOTrainer`` (``trl.trainer.utils.nanstd``,
    ``scale_rewards="group"``); a group of one has std 0 there and here. trl's epsilon is
    1e-4: pass ``eps=1e-4`` to reproduce its numbers bit for bit.

    Returns float64 (rewards are few; the precision is free).
    """
    r = _as_group(rewards)
    if r.numel() == 0:
        return r
    centred = r - r.mean()
    if not std_normalize:
        return centred
    std = r.std(correction=1) if r.numel() > 1 else torch.zeros((), dtype=r.dtype, device=r.device)
    return centred / (std + eps)


def max_rl_advantages(rewards: Tensor | Sequence[float], eps: float = 1e-6) -> Tensor:
    """(G,) MaxRL advantages (arXiv 2602.02710): ``(r - mean) / (mean + eps)``.

    Dividing by the mean success rate instead of the std turns the group estimate into the
    gradient of a truncated maximum-likelihood objective whose truncation order is the
    group size G. A group with ``mean(r) <= 0`` (nothing solved) carries no signal: all 0.
    """
    r = _as_group(rewards)
    if r.numel() == 0:
        return r
    mean = r.mean()
    if float(mean) <= 0.0:
        return torch.zeros_like(r)
    return (r - mean) / (mean + eps)


def length_penalty(
    lengths: Tensor | Sequence[int], *, coefficient: float, target: int | None
) -> Tensor:
    """(G,) non-negative penalties, subtracted from the rewards before the advantage.

    Shape: linear beyond a target length, in units of the target,
    ``coefficient * max(0, L - target) / target`` (0 at or below the target; a completion
    twice the target costs ``coefficient``). ``coefficient == 0`` disables it (all zeros).
    ``L`` counts the tokens the policy sampled (observation tokens are free).
    """
    n = torch.as_tensor(lengths, dtype=torch.float64, device="cpu")
    if coefficient == 0.0:
        return torch.zeros_like(n)
    if target is None or target < 1:
        raise ValueError(
            f"length penalty coefficient {coefficient} needs a target length >= 1, got {target}; "
            "set advantage.length_target"
        )
    return coefficient * (n - target).clamp_min(0.0) / target


def broadcast_to_tokens(advantage: float, completion_mask: Sequence[int]) -> list[float]:
    """A rollout's advantage on each sampled completion token, 0.0 on observation tokens."""
    value = float(advantage)
    return [value if m else 0.0 for m in completion_mask]


def align_prefill_logprobs(
    scored: Sequence[float], index: Sequence[int], start: int
) -> list[float]:
    """Map a scorer's log-probs of a context back onto a sample's token positions.

    Args:
        scored: log-probs of ``context[start:]`` (entry k is token ``start + k``), as a
            :class:`~composer_replication.algo.scoring.PrefillScorer` returns them.
        index: per token p of the sample, the position of the same token in the context,
            or -1 where there is none.
        start: the first scored context position.

    Returns:
        One value per sample token: the scored log-prob at ``index[p]``, 0.0 where the token
        has no counterpart or lies before ``start``.
    """
    out = []
    for p, pos in enumerate(index):
        if pos < start:
            out.append(0.0)
            continue
        k = pos - start
        if k >= len(scored):
            raise ValueError(
                f"token {p} maps to context position {pos}, but only {len(scored)} log-probs "
                f"were scored from position {start}"
            )
        out.append(float(scored[k]))
    return out
