"""Token-id lists as one left-padded batch: what every prefill of the decode loops feeds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from composer_replication.inference.decoding.uploads import to_device_async
from composer_replication.samples.padding import stacked_pad

__all__ = ["left_pad"]


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, *, device: Any = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) left-padded ids and attention mask on ``device``: built on the host as one
    (2, B, T) tensor (:func:`composer_replication.samples.padding.stacked_pad`) and moved in one
    non-blocking copy (:func:`.uploads.to_device_async`)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    both = to_device_async(stacked_pad(prompts, pad_id, left=True), device)
    return both[0], both[1]
