"""How many token positions the learner's forwards computed, and how many of them were
padding: the count behind a step's ``tokens/padding_fraction`` metric.

Every forward of :func:`composer_replication.model_parts.last_hidden_states` records its
positions here from host lists (the rows' lengths, the packed layout's size), never from a
device tensor: reading one back would make the host wait for the device. A forward whose
row lengths the host does not know (a 2-D mask without ``row_tokens``) records nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["ForwardTokens", "counting_forward_tokens", "padded_rows_tokens", "record_forward"]


@dataclass(eq=False)  # open counters are told apart by identity
class ForwardTokens:
    """Token positions the forwards inside a :func:`counting_forward_tokens` block computed
    (``computed``), of which ``padded`` held padding."""

    computed: int = 0
    padded: int = 0

    @property
    def padding_fraction(self) -> float:
        """``padded / computed`` (0.0 before any forward)."""
        return self.padded / self.computed if self.computed else 0.0


#: the counters of the open blocks (nested blocks each count every forward)
_active: list[ForwardTokens] = []


@contextmanager
def counting_forward_tokens(counter: ForwardTokens | None = None) -> Iterator[ForwardTokens]:
    """Within the block, every recorded forward adds its positions to ``counter`` (a new
    one by default), which the block yields."""
    counter = ForwardTokens() if counter is None else counter
    _active.append(counter)
    try:
        yield counter
    finally:
        _active.remove(counter)


def record_forward(computed: int, padded: int) -> None:
    """Add one forward's ``computed`` positions (``padded`` of them padding) to every open
    counter."""
    if padded < 0 or padded > computed:
        raise ValueError(f"padded={padded} must lie in [0, computed={computed}]")
    for counter in _active:
        counter.computed += computed
        counter.padded += padded


def padded_rows_tokens(row_lengths: Sequence[int], width: int) -> tuple[int, int]:
    """``(computed, padded)`` of one forward over rows of ``row_lengths`` real tokens padded
    to ``width``: ``(B * width, B * width - sum(lengths))``."""
    computed = len(row_lengths) * width
    return computed, computed - sum(row_lengths)
