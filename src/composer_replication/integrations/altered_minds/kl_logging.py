"""Token-mean KL: the unit of every KL this project logs and gates on.

A KL between two policies is measured per token (nats at one position, over the
vocabulary or estimated from the sampled token) and reported as the mean over the counted
tokens: **nats/token**. ``HeldOutGuard.update(kl_to_init=...)`` and its ``kl_hard_stop``
(0.08 by default) are in this unit. A sequence-summed KL is larger by the response length
and is never what the guard expects.

- :func:`token_kl_sum` reduces per-token values on their device (no host read): their sum
  over a mask and the number of counted tokens; rounding noise below 0 is clamped to 0 (a KL
  is >= 0), so models that agree give exactly 0.
- :func:`token_mean_kl` is the mean in nats/token as a Python float, from per-token values
  (with an optional mask) or from a sum and its token count (e.g. added up over batches or
  data-parallel ranks). It reads the device once.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

__all__ = ["token_kl_sum", "token_mean_kl"]


def token_kl_sum(
    per_token_kl: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum, count)``: the float64 sum of ``per_token_kl`` (clamped at 0) over the tokens
    where ``mask`` is nonzero (every element when None) and the int64 count of those tokens,
    both 0-d tensors on ``per_token_kl``'s device. Nothing is read to the host.

    Raises:
        ValueError: ``mask`` does not have ``per_token_kl``'s shape.
    """
    values = per_token_kl.detach().clamp_min(0.0).double()
    if mask is None:
        return values.sum(), torch.tensor(values.numel(), device=values.device)
    if mask.shape != per_token_kl.shape:
        raise ValueError(
            f"mask {tuple(mask.shape)} must have the per-token KL's shape "
            f"{tuple(per_token_kl.shape)}"
        )
    keep = mask.to(device=values.device) != 0
    return torch.where(keep, values, 0.0).sum(), keep.sum()


def token_mean_kl(per_token_kl: Any, mask: Any = None) -> float:
    """Token-mean KL in nats/token (0.0 when no token is counted).

    Two forms:

    - ``token_mean_kl(per_token_kl, mask=None)``: a tensor of per-token KL values (any
      shape) and an optional mask of the same shape (nonzero = counted);
    - ``token_mean_kl(kl_sum, n_tokens)``: the KL already summed over ``n_tokens`` tokens
      (a number or a 0-d tensor, and an int or a 0-d integer tensor).

    Tensors are read to the host once (sum and count together).

    Raises:
        ValueError: a negative token count, a mask of the wrong shape, or a non-finite or
            negative result (a KL is >= 0).
    """
    summed = not isinstance(per_token_kl, torch.Tensor) or (
        per_token_kl.dim() == 0 and mask is not None and _is_count(mask)
    )
    if summed:
        if mask is None or not _is_count(mask):
            raise ValueError(
                "token_mean_kl(kl_sum, n_tokens): a summed KL needs its token count as an int"
            )
        total, count = _read_pair(per_token_kl, mask)
    else:
        total, count = _read_pair(*token_kl_sum(per_token_kl, mask))
    if count < 0:
        raise ValueError(f"the token count must be >= 0, got {count}")
    mean = total / count if count else 0.0
    if not math.isfinite(mean) or mean < 0:
        raise ValueError(f"token-mean KL must be a finite number >= 0, got {mean}")
    return mean


def _is_count(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.is_floating_point() and value.dtype != torch.bool
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _read_pair(total: Any, count: Any) -> tuple[float, int]:
    """``(float(total), int(count))`` with at most one device read for tensors."""
    tensors = [v for v in (total, count) if isinstance(v, torch.Tensor)]
    if len(tensors) == 2:
        t, c = torch.stack([total.double(), count.to(total.device).double()]).tolist()
        return float(t), int(c)
    return float(total), int(count)
