"""Packing: mixed algorithms, optional streams, the alignment invariant."""

from __future__ import annotations

import pytest
import torch

from composer_replication.rollout import Rollout
from composer_replication.wire import DPOPairTokens, TrainingSample, pack_samples


def _rl(n: int, start: int = 10) -> TrainingSample:
    ids = list(range(start, start + n))
    return TrainingSample(
        ids,
        [0, *([1] * (n - 1))],
        [0.0, *([-1.0] * (n - 1))],
        advantages=[0.0, *([0.5] * (n - 1))],
        source="grpo",
    )


def test_mixed_algorithms_pack_with_aligned_streams():
    rl = _rl(6)
    sft = TrainingSample(
        [1, 2, 3, 4],
        [0, 1, 1, 1],
        [0.0] * 4,
        rl_weights=[0.0] * 4,
        ce_weights=[0.0, 1.0, 1.0, 1.0],
        source="sft",
    )
    opd = _rl(5, start=40)
    opd.rl_weights, opd.advantages = [0.0] * 5, None
    opd.ref_kl_weights, opd.ref_logprobs = [0.0, 1, 1, 1, 1], [0.0, -0.5, -0.6, -0.7, -0.8]
    pair = TrainingSample([], [], [], dpo=DPOPairTokens([1, 2, 3], [0, 1, 1], [1, 2, 4], [0, 0, 1]))
    (mb,) = pack_samples([rl, sft, opd, pair], max_tokens=1000)
    assert mb.input_ids.shape == (3, 6)
    mb.assert_aligned()
    rows = {tuple(s.input_ids): i for i, s in enumerate(mb.samples) if s.input_ids}
    r_sft, r_rl, r_opd = rows[(1, 2, 3, 4)], rows[tuple(rl.input_ids)], rows[tuple(opd.input_ids)]
    # ce present only where given; filler 0.0 elsewhere and in padding
    assert mb.ce_weights[r_sft].tolist() == [0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert mb.ce_weights[r_rl].sum() == 0
    # absent rl stream = weight 1 on trainable tokens; explicit zeros stay zeros
    assert mb.rl_weights[r_rl].tolist() == [0.0, 1, 1, 1, 1, 1]
    assert mb.rl_weights[r_sft].sum() == 0 and mb.rl_weights[r_opd].sum() == 0
    # ref-bearing row next to ref-less rows: zeros where no reference exists
    assert mb.ref_logprobs[r_opd, :5].tolist() == pytest.approx([0.0, -0.5, -0.6, -0.7, -0.8])
    assert mb.ref_logprobs[r_rl].sum() == 0
    assert mb.attention_mask[r_sft].tolist() == [1, 1, 1, 1, 0, 0]
    assert len(mb.pairs) == 1 and mb.jsd_weights is None


def test_token_budget_splits_micro_batches():
    samples = [_rl(n) for n in (4, 5, 6, 7, 8)]
    batches = pack_samples(samples, max_tokens=16)
    assert sum(mb.n_rows for mb in batches) == 5
    for mb in batches:
        assert mb.input_ids.numel() <= 16 or mb.n_rows == 1
    (big,) = pack_samples([_rl(30)], max_tokens=16)  # too long: alone, never split
    assert big.input_ids.shape == (1, 30)


@pytest.mark.parametrize("field", ["loss_mask", "inference_logprobs", "advantages", "ce_weights"])
def test_misaligned_stream_fails_at_pack_time(field):
    s = _rl(6)
    setattr(s, field, [0.0] * 5)
    with pytest.raises(ValueError, match=field):
        pack_samples([s], max_tokens=100)


def test_live_rl_tokens_without_advantages_fail():
    s = _rl(6)
    s.advantages = None
    with pytest.raises(ValueError, match="advantages is None"):
        pack_samples([s], max_tokens=100)


def test_jsd_alignment_is_checked():
    s = _rl(6)
    s.jsd_weights = [0.0, 0, 0, 0, 1.0, 1.0]
    with pytest.raises(ValueError, match="teacher_input_ids"):
        s.check_alignment()
    s.teacher_input_ids = [99, 98, 14, 15]
    s.teacher_index = [-1, -1, -1, -1, 2, 3]
    s.check_alignment()
    s.teacher_index = [-1, -1, -1, -1, 3, 2]  # points at the wrong tokens
    with pytest.raises(ValueError, match="teacher token"):
        s.check_alignment()
    s.teacher_index = [-1, -1, -1, -1, 2, 3]
    (mb,) = pack_samples([s, _rl(3)], max_tokens=100)
    assert mb.teacher_input_ids.shape == (2, 4)
    assert mb.teacher_index[1].tolist() == [-1] * 6 or mb.teacher_index[0].tolist() == [-1] * 6


def test_bad_pairs_and_rollouts_raise():
    with pytest.raises(ValueError, match="selects no token"):
        DPOPairTokens([1, 2], [0, 0], [1, 3], [0, 1])
    with pytest.raises(ValueError, match="entries"):
        DPOPairTokens([1, 2], [0], [1, 3], [0, 1])
    with pytest.raises(ValueError, match="inference_logprobs"):
        Rollout("t", [1, 2], [3, 4, 5], [-1.0, -1.0])
    r = Rollout("t", [1, 2], [3, 4], [-1.0, -2.0], completion_mask=[1, 0])
    assert r.input_ids == [1, 2, 3, 4] and r.n_sampled_tokens == 1
    with pytest.raises(ValueError, match="max_tokens"):
        pack_samples([_rl(3)], max_tokens=0)


def test_dtypes_of_packed_tensors():
    (mb,) = pack_samples([_rl(4)], max_tokens=100)
    assert mb.input_ids.dtype == torch.long and mb.inference_logprobs.dtype == torch.float32
