"""Packing: mixed algorithms, optional streams, the alignment invariant."""

from __future__ import annotations

import pytest
import torch

from composer_replication.rollout import Rollout
from composer_replication.samples.wire import DPOPairTokens, TrainingSample, pack_samples


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
    samples = [_rl(n, start=20 * n) for n in (4, 5, 6, 7, 8)]  # no prefix in common
    batches = pack_samples(samples, max_tokens=16)
    assert sum(mb.n_rows for mb in batches) == 5
    assert [mb.forward_tokens for mb in batches] == [4 + 5 + 6, 7 + 8]
    for mb in batches:
        assert mb.forward_tokens <= 16 or mb.n_rows == 1


def test_a_shared_prefix_counts_once_against_the_budget():
    """Rows that share a prefix (a group's prompt) compute it once: five rows of 4-8 tokens
    that all start 10, 11, 12, 13 are 8 distinct tokens, one micro-batch of 16."""
    samples = [_rl(n) for n in (4, 5, 6, 7, 8)]
    (mb,) = pack_samples(samples, max_tokens=16)
    assert mb.n_rows == 5 and mb.forward_tokens == 8 and mb.input_ids.numel() == 40
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


# ---------------------------------------------------------------- the micro-batch budget


def _sdpo(n: int, hint: int, start: int) -> TrainingSample:
    """An rl sample whose completion (the last half) is distilled from a hinted context."""
    s = _rl(n, start=start)
    cut = n // 2
    s.teacher_input_ids = list(range(200, 200 + hint)) + s.input_ids
    s.teacher_index = [-1] * cut + [hint + p for p in range(cut, n)]
    s.jsd_weights = [0.0] * cut + [1.0] * (n - cut)
    return s


def _pair(k: int, weight: float = 1.0, length: int = 6) -> DPOPairTokens:
    prompt = [3, 4 + k % 5]
    chosen = [*prompt, *range(50 + k, 50 + k + length - 2)]
    rejected = [*prompt, *range(90 + k, 90 + k + length - 3)]
    mask = lambda ids: [0, 0, *([1] * (len(ids) - 2))]  # noqa: E731
    pair = DPOPairTokens(chosen, mask(chosen), rejected, mask(rejected), weight=weight)
    pair.ref_chosen_logp, pair.ref_rejected_logp = -3.0 - 0.1 * k, -2.5 + 0.05 * k
    return pair


def _pair_only(pair: DPOPairTokens) -> TrainingSample:
    return TrainingSample([], [], [], dpo=pair, source="replay_dpo")


def test_teacher_contexts_and_pairs_count_against_the_budget():
    samples = [_sdpo(8, 4, 10 * i) for i in range(6)] + [_pair_only(_pair(k)) for k in range(8)]
    batches = pack_samples(samples, max_tokens=40, split=None)
    # each sdpo sample costs 8 student + 12 teacher tokens, the 4 hint tokens that start
    # every teacher context computed once: 16 + 4 + 16 = 36 for two, 52 for three
    assert [mb.n_rows for mb in batches[:3]] == [2, 2, 2]
    assert batches[0].forward_tokens == 2 * 8 + 4 + 2 * 8 == 36
    assert all(mb.forward_tokens <= 40 for mb in batches)
    # a pair's sides share their 2-token prompt (6 + 3 tokens), pairs share the first
    # prompt token (8 after the first), k and k + 5 the whole prompt (7): none fits beside
    # the rows; pairs 0-3 and 5 fill one micro-batch to 40, pairs 4, 6 and 7 the next
    assert [len(mb.pairs) for mb in batches] == [0, 0, 0, 5, 3]
    assert [mb.forward_tokens for mb in batches[3:]] == [9 + 8 + 8 + 8 + 7, 9 + 8 + 8]
    assert sum(mb.counts["dpo"] for mb in batches) == 8
    assert sum(mb.counts["jsd"] for mb in batches) == 6 * 4


def test_pairs_fill_the_room_the_rows_leave_and_a_wide_pair_goes_alone():
    samples = [_rl(10), _rl(10, start=30), *(_pair_only(_pair(k)) for k in range(3))]
    wide = _pair(9, length=30)  # 2 x 30 tokens: over any 40-token micro-batch
    batches = pack_samples([*samples, _pair_only(wide)], max_tokens=40, split=None)
    assert [mb.n_rows for mb in batches] == [2, 0, 0]
    # 20 + 9 + 8; then 9 (the third pair alone, no room left); the wide pair alone
    assert [len(mb.pairs) for mb in batches] == [2, 1, 1]
    assert [mb.forward_tokens for mb in batches] == [37, 9, 30 + 27]
    assert batches[2].pairs == [wide]


def test_repeated_pairs_merge_with_summed_weights_and_every_copy_counted():
    a, b = _pair(1, weight=0.5), _pair(2, weight=2.0)
    a_again = _pair(1, weight=0.25)  # another object, the same pair
    zero = _pair(2, weight=0.0)  # a zero weight merges, and is not counted
    drawn = [a, b, a, a_again, b, zero]
    (mb,) = pack_samples([_pair_only(p) for p in drawn], max_tokens=1000, split=None)
    assert mb.pairs == [a, b] and mb.pairs[0] is a
    assert mb.pair_rows.weights.tolist() == [1.25, 4.0]
    assert mb.pair_rows.input_ids.shape[0] == 4  # 2 rows per distinct pair, not 12
    assert mb.counts["dpo"] == 5
    other_reference = _pair(1)
    other_reference.ref_chosen_logp = -9.0  # scored differently: not the same signal
    (mb,) = pack_samples([_pair_only(a), _pair_only(other_reference)], max_tokens=1000, split=None)
    assert len(mb.pairs) == 2


@pytest.fixture(scope="module")
def policy():
    from composer_replication.model.loading import tiny_model

    return tiny_model(seed=0, vocab_size=256).double().train()


def _step(policy, batches) -> tuple[float, list[torch.Tensor]]:
    """The step's total loss and the gradient it leaves on a fresh copy of ``policy``."""
    import copy

    from composer_replication.training.step import train_step

    model = copy.deepcopy(policy)
    metrics = train_step(model, batches)
    return metrics["loss"], [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_the_loss_and_gradient_do_not_depend_on_how_samples_are_spread(policy):
    drawn = [_pair(k % 5, weight=0.05 * (1 + k % 3)) for k in range(16)]  # repeats
    samples = [
        *(_sdpo(8 + i % 3, 4, 10 * i) for i in range(6)),
        _rl(7, start=5),
        _rl(11, start=60),
        *(_pair_only(p) for p in drawn),
    ]
    one = pack_samples(samples, max_tokens=100_000, split=None)
    several = pack_samples(samples, max_tokens=40, split=None)
    assert len(one) == 1 and len(several) >= 5
    assert all(mb.forward_tokens <= 40 for mb in several)
    assert sum(bool(mb.pairs) for mb in several) >= 2  # the pairs are spread
    loss_one, grads_one = _step(policy, one)
    loss_several, grads_several = _step(policy, several)
    assert loss_several == pytest.approx(loss_one, abs=1e-6, rel=1e-6)
    assert len(grads_one) == len(grads_several) > 0
    for g1, g2 in zip(grads_one, grads_several):
        torch.testing.assert_close(g2, g1, rtol=1e-6, atol=1e-6)


def test_merged_pairs_train_as_their_repeated_rows(policy):
    import copy

    from composer_replication.ops.pairs import PairLossSettings, pair_terms

    drawn = [_pair(k % 3, weight=0.1 * (1 + k)) for k in range(9)]  # 3 pairs, 3 copies each
    (mb,) = pack_samples([_pair_only(p) for p in drawn], max_tokens=1000, split=None)
    assert mb.pair_rows.input_ids.shape[0] == 6 and mb.counts["dpo"] == 9
    loss, grads = _step(policy, [mb])
    # the reference: every copy's own two rows, weighted and divided by the pairs drawn
    model = copy.deepcopy(policy)
    per_pair = pair_terms(model, drawn, PairLossSettings())
    weights = torch.tensor([p.weight for p in drawn], dtype=per_pair.dtype)
    expected = (weights * per_pair).sum() / len(drawn)
    expected.backward()
    assert loss == pytest.approx(float(expected.detach()), abs=1e-6, rel=1e-6)
    expected_grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(expected_grads) == len(grads) > 0
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
