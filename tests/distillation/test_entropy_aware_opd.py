"""Entropy-aware OPD loss and teacher entropy, against plain-Python values on tiny vocabularies."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from composer_replication.distillation import entropy_aware_opd_loss, teacher_entropy

STUDENT = [[[1.0, 0.0, -1.0], [0.5, 2.0, -0.5]]]  # (B=1, T=2, V=3)
TEACHER = [[[0.0, 2.0, 1.0], [0.1, 0.0, 0.2]]]  # second token: near-uniform teacher


def _softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    exps = [math.exp(x - m) for x in xs]
    return [e / sum(exps) for e in exps]


def _entropy(p: list[float]) -> float:
    return -sum(pi * math.log(pi) for pi in p if pi > 0)


def _kl(a: list[float], b: list[float]) -> float:
    return sum(ai * math.log(ai / bi) for ai, bi in zip(a, b, strict=True) if ai > 0)


def _hand_token_loss(s, te, *, h_max=None, temperature=1.0) -> float:
    q = _softmax([x / temperature for x in s])
    p = _softmax([x / temperature for x in te])
    h_max = math.log(len(s)) if h_max is None else h_max
    w = min(1.0, max(0.0, _entropy(p) / h_max))
    return w * _kl(p, q) + (1 - w) * _kl(q, p)


def _tensors(dtype=torch.float64):
    return torch.tensor(STUDENT, dtype=dtype), torch.tensor(TEACHER, dtype=dtype)


@pytest.mark.parametrize("vocab", [3, 4, 5])
def test_teacher_entropy_of_uniform_logits_is_log_v(vocab):
    logits = torch.full((2, 3, vocab), 0.7)
    out = teacher_entropy(logits)
    assert out.shape == (2, 3)
    torch.testing.assert_close(out, torch.full((2, 3), math.log(vocab)))


def test_teacher_entropy_matches_hand_values():
    _, teacher = _tensors()
    expected = [_entropy(_softmax(row)) for row in TEACHER[0]]
    torch.testing.assert_close(
        teacher_entropy(teacher), torch.tensor([expected], dtype=torch.float64)
    )
    # A -inf entry is an impossible token: entropy is that of the remaining ones.
    masked = torch.tensor([[[0.0, 2.0, float("-inf")]]])
    assert teacher_entropy(masked).item() == pytest.approx(_entropy(_softmax([0.0, 2.0])), rel=1e-6)
    # Stable for huge logits where softmax then log would underflow to log(0).
    peaked = torch.tensor([[[1000.0, 0.0, 0.0]]])
    assert teacher_entropy(peaked).item() == pytest.approx(0.0, abs=1e-30)


def test_loss_matches_hand_computed_values_for_all_reductions():
    student, teacher = _tensors()
    per_token = [_hand_token_loss(s, te) for s, te in zip(STUDENT[0], TEACHER[0], strict=True)]
    labels = torch.tensor([[1, 0]])

    none = entropy_aware_opd_loss(student, teacher, labels=labels, reduction="none")
    torch.testing.assert_close(none, torch.tensor([[per_token[0], 0.0]], dtype=torch.float64))
    for reduction in ("batchmean", "mean", "sum"):
        out = entropy_aware_opd_loss(student, teacher, labels=labels, reduction=reduction)
        assert out.item() == pytest.approx(per_token[0], rel=1e-12)

    unmasked = entropy_aware_opd_loss(student, teacher)
    assert unmasked.item() == pytest.approx(sum(per_token) / 2, rel=1e-12)
    total = entropy_aware_opd_loss(student, teacher, reduction="sum")
    assert total.item() == pytest.approx(sum(per_token), rel=1e-12)
    full = entropy_aware_opd_loss(student, teacher, labels=torch.ones(1, 2, dtype=torch.bool))
    assert full.item() == pytest.approx(sum(per_token) / 2, rel=1e-12)


def test_loss_batchmean_divides_by_counted_tokens_across_batch():
    torch.manual_seed(0)
    student = torch.randn(2, 3, 4, dtype=torch.float64)
    teacher = torch.randn(2, 3, 4, dtype=torch.float64)
    labels = torch.tensor([[1, 1, 0], [0, 1, 0]])
    per_token = [
        _hand_token_loss(student[b, s].tolist(), teacher[b, s].tolist())
        for b, s in [(0, 0), (0, 1), (1, 1)]
    ]
    out = entropy_aware_opd_loss(student, teacher, labels=labels)
    assert out.item() == pytest.approx(sum(per_token) / 3, rel=1e-12)


def test_loss_temperature_and_h_max_match_hand_values():
    student, teacher = _tensors()
    for temperature, h_max in [(2.0, None), (0.5, 0.3), (1.0, 5.0)]:
        expected = [
            _hand_token_loss(s, te, h_max=h_max, temperature=temperature)
            for s, te in zip(STUDENT[0], TEACHER[0], strict=True)
        ]
        out = entropy_aware_opd_loss(
            student, teacher, h_max=h_max, temperature=temperature, reduction="none"
        )
        torch.testing.assert_close(out, torch.tensor([expected], dtype=torch.float64))


def test_uniform_teacher_gives_forward_kl_and_tiny_h_max_too():
    torch.manual_seed(1)
    student = torch.randn(1, 3, 5, dtype=torch.float64)
    uniform = torch.zeros(1, 3, 5, dtype=torch.float64)
    log_q, log_p = student.log_softmax(-1), uniform.log_softmax(-1)
    forward = F.kl_div(log_q, log_p, log_target=True, reduction="sum") / 3  # per-token mean
    torch.testing.assert_close(entropy_aware_opd_loss(student, uniform), forward)

    teacher = torch.randn(1, 3, 5, dtype=torch.float64)
    forward = (teacher.softmax(-1) * (teacher.log_softmax(-1) - student.log_softmax(-1))).sum(-1)
    out = entropy_aware_opd_loss(student, teacher, h_max=1e-9, reduction="none")
    torch.testing.assert_close(out, forward)


def test_near_one_hot_teacher_gives_reverse_kl():
    student = torch.tensor([[[0.3, -0.2, 0.1, 0.0]]], dtype=torch.float64)
    teacher = torch.tensor([[[30.0, 0.0, 0.0, 0.0]]], dtype=torch.float64)
    q, p = student.softmax(-1), teacher.softmax(-1)
    reverse = (q * (q.log() - p.log())).sum()
    out = entropy_aware_opd_loss(student, teacher)
    assert out.item() == pytest.approx(reverse.item(), rel=1e-9)


def test_entropy_weight_carries_no_gradient():
    torch.manual_seed(2)
    student = torch.randn(2, 2, 3, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(2, 2, 3, dtype=torch.float64, requires_grad=True)
    temperature, h_max = 1.5, 0.9
    entropy_aware_opd_loss(student, teacher, temperature=temperature, h_max=h_max).backward()

    s, te = student.detach().requires_grad_(), teacher.detach().requires_grad_()
    log_q, log_p = (s / temperature).log_softmax(-1), (te / temperature).log_softmax(-1)
    weight = (teacher_entropy(te.detach() / temperature) / h_max).clamp(0, 1)  # a constant
    fkl = (log_p.exp() * (log_p - log_q)).sum(-1)
    rkl = (log_q.exp() * (log_q - log_p)).sum(-1)
    (weight * fkl + (1 - weight) * rkl).mean().backward()
    torch.testing.assert_close(student.grad, s.grad)
    torch.testing.assert_close(teacher.grad, te.grad)


def test_loss_gradcheck_on_student_logits():
    torch.manual_seed(3)
    student = torch.randn(2, 2, 4, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(2, 2, 4, dtype=torch.float64)
    labels = torch.tensor([[1, 0], [1, 1]])
    assert torch.autograd.gradcheck(
        lambda s: entropy_aware_opd_loss(s, teacher, labels=labels, temperature=0.7), student
    )


def test_nothing_counted_gives_zero_with_gradient():
    student, teacher = _tensors()
    student.requires_grad_()
    loss = entropy_aware_opd_loss(student, teacher, labels=torch.zeros(1, 2))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(student.grad, torch.zeros_like(student))


def test_vocab_padding_masked_in_both_models_changes_nothing():
    torch.manual_seed(4)
    student = torch.randn(1, 3, 4, dtype=torch.float64)
    teacher = torch.randn(1, 3, 4, dtype=torch.float64)
    pad = torch.full((1, 3, 1), float("-inf"), dtype=torch.float64)
    padded_student = torch.cat([student, pad], dim=-1).requires_grad_()
    padded_teacher = torch.cat([teacher, pad], dim=-1)
    h_max = math.log(4)
    loss = entropy_aware_opd_loss(padded_student, padded_teacher, h_max=h_max)
    torch.testing.assert_close(loss, entropy_aware_opd_loss(student, teacher, h_max=h_max))
    loss.backward()
    assert torch.isfinite(padded_student.grad).all()


def test_low_precision_inputs_compute_in_float32():
    student, teacher = _tensors(torch.bfloat16)
    out = entropy_aware_opd_loss(student, teacher)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, entropy_aware_opd_loss(student.float(), teacher.float()))


def test_rejects_bad_arguments():
    student, teacher = _tensors()
    with pytest.raises(ValueError, match=r"\(1, 2, 3\) and \(1, 2, 4\)"):
        entropy_aware_opd_loss(student, torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match=r"\(B, T, V\)"):
        entropy_aware_opd_loss(student[0], teacher[0])
    with pytest.raises(ValueError, match="labels shape"):
        entropy_aware_opd_loss(student, teacher, labels=torch.ones(2, 1))
    with pytest.raises(ValueError, match="-100"):
        entropy_aware_opd_loss(student, teacher, labels=torch.tensor([[5, -100]]))
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match=f"h_max must be > 0, got {bad}"):
            entropy_aware_opd_loss(student, teacher, h_max=bad)
        with pytest.raises(ValueError, match=f"temperature must be > 0, got {bad}"):
            entropy_aware_opd_loss(student, teacher, temperature=bad)
    with pytest.raises(ValueError, match="'kl'"):
        entropy_aware_opd_loss(student, teacher, reduction="kl")
    with pytest.raises(ValueError, match="V=1"):
        entropy_aware_opd_loss(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1))
    with pytest.raises(ValueError, match="V >= 1"):
        teacher_entropy(torch.zeros(2, 0))
