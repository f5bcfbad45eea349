"""How many token positions the learner's forwards compute: before a step, what packing
budgets a micro-batch by (:class:`ForwardLoad`, from its samples' token lists); during it,
what they computed and how much of it was padding (the step's ``tokens/forward`` and
``tokens/padding_fraction`` metrics).

Every forward of :func:`composer_replication.model.parts.last_hidden_states` records its
positions here from host lists (the rows' lengths, the packed layout's size), never from a
device tensor: reading one back would make the host wait for the device. A forward whose
row lengths the host does not know (a 2-D mask without ``row_tokens``) records nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DistinctTokens",
    "ForwardLoad",
    "ForwardTokens",
    "common_prefix",
    "counting_forward_tokens",
    "forward_rows",
    "padded_rows_tokens",
    "record_forward",
]


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


# ------------------------------------------------------------------ before the step


class DistinctTokens:
    """The distinct tokens of rows that share prefixes, grown row by row: what a forward
    that computes each shared prefix once (one node per distinct prefix) computes."""

    def __init__(self) -> None:
        self._children: dict[int, dict[int, int]] = {-1: {}}
        self.size = 0

    def new_tokens(self, rows: Sequence[Sequence[int]]) -> int:
        """How many tokens ``rows`` would add, taken in order: each row's tokens after the
        longest of its prefixes already here or in an earlier row of ``rows``."""
        total = 0
        for k, row in enumerate(rows):
            shared = max([self._matched(row), *(common_prefix(row, rows[j]) for j in range(k))])
            total += len(row) - shared
        return total

    def _matched(self, row: Sequence[int]) -> int:
        node, matched = -1, 0
        for token in row:
            child = self._children.get(node, {}).get(token)
            if child is None:
                break
            node, matched = child, matched + 1
        return matched

    def add(self, row: Sequence[int]) -> None:
        """Take ``row`` in (its tokens after the longest prefix already here are new)."""
        node = -1
        for token in row:
            children = self._children.setdefault(node, {})
            child = children.get(token)
            if child is None:
                child = children[token] = self.size
                self.size += 1
            node = child


def forward_rows(
    sample: Any,
) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """The rows ``sample`` (a :class:`~composer_replication.samples.wire.TrainingSample`) adds to a
    micro-batch's three forwards: its student row, its
    teacher context (a sample with live jsd weight) and its pair's two sides."""
    student = [sample.input_ids] if sample.n_tokens else []
    live_jsd = bool(sample.n_tokens and sample.jsd_weights and any(sample.jsd_weights))
    teacher = [sample.teacher_input_ids] if live_jsd and sample.teacher_input_ids else []
    pair = sample.dpo
    pairs = [] if pair is None else [pair.chosen_ids, pair.rejected_ids]
    return student, teacher, pairs


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ForwardLoad:
    """The tokens a micro-batch being packed makes its forwards compute: the distinct
    tokens of its student rows, of its teacher contexts and of its pairs' rows (a repeat of
    a pair, or a group's shared prompt, adds nothing)."""

    def __init__(self) -> None:
        self.tries = (DistinctTokens(), DistinctTokens(), DistinctTokens())

    @property
    def tokens(self) -> int:
        """The tokens so far (what :func:`composer_replication.samples.wire.pack_samples` holds to
        ``max_tokens``)."""
        return sum(trie.size for trie in self.tries)

    def cost(self, sample: Any) -> int:
        """The tokens ``sample`` would add."""
        return sum(trie.new_tokens(rows) for trie, rows in zip(self.tries, forward_rows(sample)))

    def add(self, sample: Any) -> None:
        """Take ``sample``'s rows in."""
        for trie, rows in zip(self.tries, forward_rows(sample)):
            for row in rows:
                trie.add(row)
