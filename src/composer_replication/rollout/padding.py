"""Token-id lists as one left-padded batch: what every prefill of the decode loops feeds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["left_pad"]


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, *, device: Any = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) left-padded ids and attention mask on ``device`` (built on the host, moved once)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device="cpu")
    attn = torch.zeros((len(prompts), width), dtype=torch.long, device="cpu")
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long, device="cpu")
        attn[i, width - len(p) :] = 1
    return ids.to(device), attn.to(device)
