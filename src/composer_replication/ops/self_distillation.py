"""The self-distillation channel (SDPO, arXiv 2601.20802): student and teacher contexts that
share a response, compared token by token at aligned positions.

The student is the policy on the plain context; the teacher reads the same response
tokens behind a richer context (a hint, a demonstration) and takes no gradient. A response
token at position ``p`` of the student sequence and ``p'`` of the teacher sequence is
predicted by the hidden states at ``p - 1`` and ``p' - 1``; :func:`divergence_terms` runs
the teacher forward (only on rows that distil something), gathers both sides' hidden rows
and hands them to :func:`~composer_replication.ops.divergence.token_divergence`.

Every batch layout reduces to :class:`AlignedTokens` (batch row, student position, teacher
position per distilled token): :func:`aligned_from_index` for the trainer's packed
micro-batches (a per-token ``teacher_index``), :func:`aligned_from_masks` for the
``compose_loss`` / trl layout (response masks in both contexts plus the distillation mask).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from composer_replication.model.parts import last_hidden_states, lm_head_weight
from composer_replication.ops.divergence import DivergenceSettings, token_divergence

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["AlignedTokens", "aligned_from_index", "aligned_from_masks", "divergence_terms"]


@dataclass(frozen=True)
class AlignedTokens:
    """Distilled tokens: (M,) batch rows, student positions and teacher positions (>= 1).

    ``teacher_rows`` (the rows that have distilled tokens, sorted) and ``teacher_slot``
    (each token's index in them) may come from host data (a packed micro-batch has them);
    else :func:`divergence_terms` finds them with ``unique``, which reads the device.
    """

    rows: Tensor
    student: Tensor
    teacher: Tensor
    teacher_rows: Tensor | None = None
    teacher_slot: Tensor | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.rows.numel())


def aligned_from_index(token_weights: Tensor, teacher_index: Tensor) -> AlignedTokens:
    """Tokens with a non-zero weight in (B, T) ``token_weights``; their teacher position
    comes from (B, T) ``teacher_index`` (the packed micro-batch layout)."""
    rows, positions = (token_weights != 0).nonzero(as_tuple=True)
    return AlignedTokens(rows, positions, teacher_index[rows, positions])


def aligned_from_masks(
    student_ids: Tensor,
    student_response_mask: Tensor,
    teacher_ids: Tensor,
    teacher_response_mask: Tensor,
    distill_mask: Tensor,
) -> AlignedTokens:
    """Response token k of row b in the student context pairs with response token k of the
    same row in the teacher context; ``distill_mask`` (student shape) selects the tokens.

    Raises ``ValueError`` when a row holds a different number of response tokens in the two
    contexts, or different token ids: both contexts must carry the SAME response ids.
    """
    rows, s_pos, t_pos = [], [], []
    for b in range(student_ids.shape[0]):
        s = student_response_mask[b].nonzero().squeeze(-1)
        t = teacher_response_mask[b].nonzero().squeeze(-1)
        if s.numel() != t.numel():
            raise ValueError(
                f"row {b}: {s.numel()} response tokens in the student context but "
                f"{t.numel()} in the teacher context; both must hold the same response"
            )
        if not torch.equal(student_ids[b, s], teacher_ids[b, t]):
            raise ValueError(
                f"row {b}: the teacher context's response tokens differ from the student's; "
                "tokenise the response once and append the same ids to both contexts"
            )
        keep = (distill_mask[b, s] != 0) & (s > 0) & (t > 0)
        rows.append(torch.full_like(s[keep], b))
        s_pos.append(s[keep])
        t_pos.append(t[keep])
    empty = student_ids.new_zeros(0)
    return AlignedTokens(
        torch.cat(rows) if rows else empty,
        torch.cat(s_pos) if s_pos else empty,
        torch.cat(t_pos) if t_pos else empty,
    )


def divergence_terms(
    student_hidden: Tensor,
    weight: Tensor,
    teacher: Any,
    teacher_ids: Tensor,
    teacher_attention_mask: Tensor | None,
    tokens: AlignedTokens,
    settings: DivergenceSettings,
    *,
    teacher_tokens: Sequence[Sequence[int]] | None = None,
) -> Tensor:
    """Per-token divergence (M,) of the distilled tokens; the teacher forward runs here.

    Args:
        student_hidden: (B, T, H) the policy's final hidden states on the student rows.
        weight: (V, H) the policy's LM-head weight.
        teacher: the model behind the teacher context (run under ``no_grad``).
        teacher_ids / teacher_attention_mask: (B, T') teacher contexts, row b aligned with
            student row b.
        tokens: which tokens are distilled and where they sit in both contexts.
        settings: the divergence and its knobs.
        teacher_tokens: host token lists of the teacher rows the forward runs on (those of
            ``tokens.teacher_rows``, unpadded): the forward then plans from them instead of
            reading the ids back from the device.
    """
    if tokens.n_tokens == 0:
        return student_hidden.new_zeros(0, dtype=torch.float32)
    if tokens.teacher_rows is None or tokens.teacher_slot is None:
        needed, inverse = torch.unique(tokens.rows, return_inverse=True)
    else:
        needed, inverse = tokens.teacher_rows, tokens.teacher_slot
    with torch.no_grad():
        attention = None if teacher_attention_mask is None else teacher_attention_mask[needed]
        teacher_hidden = last_hidden_states(
            teacher, teacher_ids[needed], attention, row_tokens=teacher_tokens
        )
        teacher_weight = lm_head_weight(teacher)
    student_rows = student_hidden[tokens.rows, tokens.student - 1]
    teacher_rows = teacher_hidden[inverse, tokens.teacher - 1]
    return token_divergence(student_rows, weight, teacher_rows, teacher_weight, settings)
