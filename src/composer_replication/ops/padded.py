"""Padded batches as training samples, so they reach the one loss assembler.

``loss.compose_loss`` takes a dict of padded (B, T) tensors, and the trl trainer's inputs
are padded the same way. Both convert their rows into
:class:`~composer_replication.samples.wire.TrainingSample` s here (padding dropped, positions
re-indexed), pack them, and run :func:`composer_replication.ops.assembler.micro_batch_losses`
on every micro-batch, the call the native trainer step makes: one implementation of the
loss for every path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from composer_replication.config.loss import LossConfig
from composer_replication.ops.assembler import micro_batch_losses
from composer_replication.samples.wire import DPOPairTokens, TrainingSample, pack_samples

if TYPE_CHECKING:
    from torch import Tensor

    from composer_replication.ops.divergence import DivergenceSettings
    from composer_replication.ops.self_distillation import AlignedTokens

__all__ = ["PaddedLosses", "padded_losses", "padded_samples"]


@dataclass
class PaddedLosses:
    """Per-component sums (with grad) and their token (pair) counts."""

    sums: dict[str, Tensor]
    counts: dict[str, int]

    def mean(self, component: str, like: Tensor) -> Tensor:
        """The component's mean, or an exact 0 on ``like``'s graph when it has no token."""
        count = self.counts.get(component, 0)
        if not count or component not in self.sums:
            return 0.0 * like
        return self.sums[component] / count


def padded_samples(
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    ce_mask: Tensor | None = None,
    teacher_ids: Tensor | None = None,
    teacher_attention_mask: Tensor | None = None,
    tokens: AlignedTokens | None = None,
) -> list[TrainingSample]:
    """One sample per row that has an attended token.

    Args:
        input_ids, attention_mask: (B, T) rows, padded on either side (no mask: every
            position is a token).
        ce_mask: (B, T) tokens that carry the ``ce`` component (weight 1).
        teacher_ids, teacher_attention_mask: (B, T') teacher contexts, row b behind row b.
        tokens: the distilled tokens (``jsd``, weight 1) and their positions in both
            contexts, in padded coordinates.
    """
    ids = input_ids.tolist()
    kept = _attended(attention_mask, len(ids), len(ids[0]) if ids else 0)
    ce_rows = ce_mask.tolist() if ce_mask is not None else None
    jsd = _jsd_by_row(tokens, teacher_ids, teacher_attention_mask)
    samples = []
    for b, positions in enumerate(kept):
        if not positions:
            continue
        n = len(positions)
        sample = TrainingSample(
            input_ids=[ids[b][t] for t in positions],
            loss_mask=[0] * n,
            inference_logprobs=[0.0] * n,
            rl_weights=[0.0] * n,
        )
        if ce_rows is not None:
            # the first token has no log-prob: it is never a target
            sample.ce_weights = [0.0] + [float(ce_rows[b][t] != 0) for t in positions[1:]]
        if b in jsd:
            teacher_row, pairs = jsd[b]
            index = {t: i for i, t in enumerate(positions)}
            sample.teacher_input_ids = teacher_row
            sample.jsd_weights = [0.0] * n
            sample.teacher_index = [-1] * n
            for student, teacher in pairs:
                sample.jsd_weights[index[student]] = 1.0
                sample.teacher_index[index[student]] = teacher
        samples.append(sample)
    return samples


def padded_losses(
    policy: Any,
    samples: Sequence[TrainingSample],
    pairs: Sequence[DPOPairTokens] = (),
    cfg: LossConfig | None = None,
    *,
    divergence: DivergenceSettings | None = None,
    teacher: Any | None = None,
    reference: Any | None = None,
) -> PaddedLosses:
    """Every component's sum and count over ``samples`` and ``pairs`` (one assembler call
    per packed micro-batch; everything is packed into as few as the longest row allows)."""
    pair_samples = [TrainingSample([], [], [], dpo=p) for p in pairs]
    everything = [*samples, *pair_samples]
    budget = sum(s.n_tokens for s in samples) + 1
    sums: dict[str, Tensor] = {}
    counts: dict[str, int] = {}
    for mb in pack_samples(everything, max_tokens=budget, split=None):
        losses = micro_batch_losses(
            policy, mb, cfg, teacher=teacher, reference=reference, divergence=divergence
        )
        for name, value in losses.components.items():
            sums[name] = value if name not in sums else sums[name] + value
        for name, count in mb.counts.items():
            counts[name] = counts.get(name, 0) + count
    return PaddedLosses(sums, counts)


def _attended(attention_mask: Tensor | None, rows: int, width: int) -> list[list[int]]:
    if attention_mask is None:
        return [list(range(width)) for _ in range(rows)]
    return [[t for t, a in enumerate(row) if a] for row in attention_mask.tolist()]


def _jsd_by_row(
    tokens: AlignedTokens | None,
    teacher_ids: Tensor | None,
    teacher_attention_mask: Tensor | None,
) -> dict[int, tuple[list[int], list[tuple[int, int]]]]:
    """Row -> (its unpadded teacher context, [(student position, teacher position in the
    unpadded teacher context)])."""
    if tokens is None or teacher_ids is None or tokens.n_tokens == 0:
        return {}
    t_ids = teacher_ids.tolist()
    t_kept = _attended(teacher_attention_mask, len(t_ids), len(t_ids[0]) if t_ids else 0)
    t_index = [{t: i for i, t in enumerate(kept)} for kept in t_kept]
    out: dict[int, tuple[list[int], list[tuple[int, int]]]] = {}
    for row, student, teacher in zip(
        tokens.rows.tolist(), tokens.student.tolist(), tokens.teacher.tolist()
    ):
        if row not in out:
            out[row] = ([t_ids[row][t] for t in t_kept[row]], [])
        out[row][1].append((student, t_index[row][teacher]))
    return out
