"""The jsd component over the teacher's top-k tokens plus one tail bucket."""

from __future__ import annotations

import math

import pytest
import torch

from composer_replication.ops.divergence import (
    DivergenceSettings,
    token_divergence,
    topk_tail_jsd_token_loss,
)


def _bucket_jsd_by_hand(
    student: list[float], teacher: list[float], k: int, beta: float, tau: float
):
    """The generalized JSD over k + 1 buckets, written out in plain Python floats."""

    def softmax(xs):
        top = max(x / tau for x in xs)
        e = [math.exp(x / tau - top) for x in xs]
        return [v / sum(e) for v in e]

    p, q = softmax(teacher), softmax(student)
    order = sorted(range(len(p)), key=lambda i: -p[i])[:k]
    big_p = [p[i] for i in order] + [1.0 - sum(p[i] for i in order)]
    big_q = [q[i] for i in order] + [1.0 - sum(q[i] for i in order)]

    def kl(a, b):
        return sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)

    if beta == 0.0:
        return kl(big_p, big_q)  # forward KL(teacher || student)
    if beta == 1.0:
        return kl(big_q, big_p)  # reverse KL(student || teacher)
    mix = [beta * x + (1 - beta) * y for x, y in zip(big_p, big_q)]
    return beta * kl(big_p, mix) + (1 - beta) * kl(big_q, mix)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_top_k_with_a_tail_bucket_matches_the_formula_by_hand(beta, k):
    student = [0.3, -1.2, 2.0, 0.7, -0.4, 1.1]
    teacher = [1.5, 0.2, -0.3, 2.2, 0.9, -1.0]
    got = topk_tail_jsd_token_loss(
        torch.tensor([student], dtype=torch.float64),
        torch.tensor([teacher], dtype=torch.float64),
        top_k=k,
        beta=beta,
        temperature=0.7,
    )
    assert got.shape == (1,)
    assert float(got[0]) == pytest.approx(_bucket_jsd_by_hand(student, teacher, k, beta, 0.7))


def test_the_tail_keeps_the_students_mass_outside_the_teachers_top_tokens():
    # equal on the teacher's top token in ratio, but the student puts its mass elsewhere:
    # a renormalised top-1 would see no difference at all, the tail bucket does
    teacher = torch.tensor([[5.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    student = torch.tensor([[0.0, 5.0, 0.0, 0.0]], dtype=torch.float64)
    assert float(topk_tail_jsd_token_loss(student, teacher, top_k=1)[0]) > 0.1
    assert float(topk_tail_jsd_token_loss(teacher, teacher, top_k=1)[0]) == pytest.approx(0.0)


def _rows(seed: int, m: int = 5, h: int = 16, v: int = 40):
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(m, h, generator=gen, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(m, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64, requires_grad=True)
    return student, teacher, weight


def test_top_k_of_the_whole_vocabulary_is_the_full_jsd_with_its_gradients():
    """The chunked top-k path at k = V against the fused full-vocabulary kernel."""
    student, teacher, weight = _rows(0)
    full = token_divergence(student, weight, teacher, settings=DivergenceSettings(beta=0.3))
    (g_full_h, g_full_w) = torch.autograd.grad(full.sum(), (student, weight))
    every = DivergenceSettings(beta=0.3, top_k=40, chunk_size=2)
    top = token_divergence(student, weight, teacher, settings=every)
    (g_top_h, g_top_w) = torch.autograd.grad(top.sum(), (student, weight))
    torch.testing.assert_close(top, full, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(g_top_h, g_full_h, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(g_top_w, g_full_w, rtol=1e-9, atol=1e-12)


def test_a_smaller_k_trains_the_student_only_and_differs_from_the_full_jsd():
    student, teacher, weight = _rows(1)
    settings = DivergenceSettings(top_k=3, chunk_size=2)
    teacher_rows = teacher.clone().requires_grad_(True)
    values = token_divergence(student, weight, teacher_rows, settings=settings)
    full = token_divergence(student, weight, teacher, settings=DivergenceSettings())
    assert values.shape == (5,) and bool((values >= 0).all())
    assert not torch.allclose(values, full)
    values.sum().backward()
    assert student.grad is not None and float(student.grad.abs().sum()) > 0
    assert teacher_rows.grad is None  # the teacher side carries no gradient


def test_top_k_is_refused_with_another_divergence_and_below_one():
    from pydantic import ValidationError

    from composer_replication.config.loss import LossConfig

    with pytest.raises(ValueError, match="works with the generalized JSD only"):
        DivergenceSettings(kind="taid", taid_t=0.5, top_k=5)
    with pytest.raises(ValueError, match="must be >= 1"):
        DivergenceSettings(top_k=0)
    with pytest.raises(ValidationError, match="sdpo_top_k = 5 works with the generalized JSD"):
        LossConfig(sdpo_top_k=5, sdpo_wrapper="entropy_opd")
    assert LossConfig(sdpo_top_k=20).sdpo_top_k == 20
