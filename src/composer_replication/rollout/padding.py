"""Token-id lists as one left-padded batch: what every prefill of the decode loops feeds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from composer_replication.rollout.uploads import to_device_async

__all__ = ["left_pad"]


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, *, device: Any = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) left-padded ids and attention mask on ``device``: built on the host as one
    (2, B, T) tensor and moved in one non-blocking copy (:func:`.uploads.to_device_async`)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    both = torch.zeros((2, len(prompts), width), dtype=torch.long, device="cpu")
    both[0].fill_(pad_id)
    for i, p in enumerate(prompts):
        both[0, i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long, device="cpu")
        both[1, i, width - len(p) :] = 1
    both = to_device_async(both, device)
    return both[0], both[1]
