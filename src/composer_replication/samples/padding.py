"""Rows of token ids padded to one width: the pad id of a tokenizer, the width (the longest
row, or a multiple above it), the padded rows as lists or as (N, W) tensors with their
attention mask.

Importing this module does not import torch; the tensor builders import it when called.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["pad_id_of", "pad_lists", "pad_rows", "padded_width", "stacked_pad"]


def pad_id_of(tokenizer: Any) -> int:
    """The tokenizer's pad token id, else its eos token id (padding is masked out, so any
    real id serves)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    if pad is None:
        raise ValueError("tokenizer has neither a pad nor an eos token id; set tokenizer.pad_token")
    return int(pad)


def padded_width(lengths: Iterable[int], multiple: int = 1) -> int:
    """The longest of ``lengths`` (0 when there is none) rounded up to ``multiple``."""
    if multiple < 1:
        raise ValueError(f"multiple={multiple} must be at least 1")
    longest = max(lengths, default=0)
    return -(-longest // multiple) * multiple


def pad_lists(
    rows: Sequence[Sequence[int]], width: int, value: int, *, left: bool = False
) -> list[list[int]]:
    """Each row filled with ``value`` to ``width`` (after it, or before it with ``left``)."""
    too_long = [len(row) for row in rows if len(row) > width]
    if too_long:
        raise ValueError(f"a row of {max(too_long)} entries does not fit width={width}")
    if left:
        return [[*([value] * (width - len(row))), *row] for row in rows]
    return [[*row, *([value] * (width - len(row)))] for row in rows]


def stacked_pad(
    rows: Sequence[Sequence[int]], value: int = 0, *, left: bool = False, width: int | None = None
) -> Tensor:
    """(2, N, W) long on the host: ``[0]`` the rows padded with ``value`` (right, or left),
    ``[1]`` the 0/1 mask of their real entries; ``W`` is ``width``, default the longest
    row. One tensor, so one copy moves both."""
    import torch

    if width is None:
        width = padded_width(len(row) for row in rows)
    both = torch.zeros((2, len(rows), width), dtype=torch.long, device="cpu")
    both[0].fill_(int(value))
    for i, row in enumerate(rows):
        if len(row) > width:
            raise ValueError(f"a row of {len(row)} entries does not fit width={width}")
        cols = slice(width - len(row), width) if left else slice(0, len(row))
        both[0, i, cols] = torch.as_tensor(list(row), dtype=torch.long, device="cpu")
        both[1, i, cols] = 1
    return both


def pad_rows(
    seqs: Sequence[Sequence[int]],
    value: int = 0,
    *,
    left: bool = False,
    width: int | None = None,
    multiple: int = 1,
    device: Any = None,
) -> tuple[Tensor, Tensor]:
    """(N, W) rows padded with ``value`` (right, or left) and their 0/1 mask of real
    entries, on ``device`` (None: the host); ``W`` is ``width`` if given, else the longest
    row rounded up to ``multiple``."""
    if width is None:
        width = padded_width((len(row) for row in seqs), multiple)
    both = stacked_pad(seqs, value, left=left, width=width).to(device)
    return both[0], both[1]
