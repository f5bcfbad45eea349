"""generalized_jsd_loss against trl's GKDTrainer.generalized_jsd_loss and hand formulas."""

from __future__ import annotations

import math
import os

import pytest
import torch

from composer_replication.opsd import generalized_jsd_loss, per_token_jsd

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.fixture(scope="module")
def trl_jsd():
    from trl.experimental.gkd import GKDTrainer

    return GKDTrainer.generalized_jsd_loss


def _inputs(seed: int, dtype=torch.float64, B: int = 2, T: int = 6, V: int = 13):
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(B, T, V, generator=gen, dtype=dtype) * 3
    teacher = torch.randn(B, T, V, generator=gen, dtype=dtype) * 3
    labels = torch.randint(0, V, (B, T), generator=gen)
    labels[0, :2] = -100
    labels[1, -1] = -100
    return student, teacher, labels


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean"])
@pytest.mark.parametrize("with_labels", [True, False])
def test_matches_trl_values_and_grads(trl_jsd, beta, temperature, reduction, with_labels):
    student, teacher, labels = _inputs(seed=int(beta * 10) + 3)
    labels = labels if with_labels else None
    s_ref, t_ref = student.clone().requires_grad_(), teacher.clone().requires_grad_()
    s_our, t_our = student.clone().requires_grad_(), teacher.clone().requires_grad_()
    ref = trl_jsd(s_ref, t_ref, labels, beta=beta, temperature=temperature, reduction=reduction)
    ours = generalized_jsd_loss(
        s_our,
        t_our,
        labels,
        beta=beta,
        temperature=temperature,
        reduction=reduction,
        chunk_size=4,
    )
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=1e-9)
    ref.backward()
    ours.backward()
    torch.testing.assert_close(s_our.grad, s_ref.grad, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(t_our.grad, t_ref.grad, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_reduction_none_is_per_token_sum_of_trl(trl_jsd, beta):
    student, teacher, labels = _inputs(seed=11)
    ref = trl_jsd(student, teacher, None, beta=beta, temperature=1.3, reduction="none")
    ours = generalized_jsd_loss(
        student, teacher, labels, beta=beta, temperature=1.3, reduction="none"
    )
    assert ours.shape == labels.shape
    mask = labels != -100
    torch.testing.assert_close(ours[mask], ref.sum(-1)[mask], atol=1e-10, rtol=1e-9)
    assert torch.all(ours[~mask] == 0)


def test_float32_matches_trl_to_1e5(trl_jsd):
    student, teacher, labels = _inputs(seed=5, dtype=torch.float32, V=257)
    for beta in (0.0, 0.1, 0.5, 0.9, 1.0):
        ref = trl_jsd(student, teacher, labels, beta=beta, temperature=0.8)
        ours = generalized_jsd_loss(student, teacher, labels, beta=beta, temperature=0.8)
        assert abs(float(ours) - float(ref)) < 1e-5


def test_chunk_size_does_not_change_the_result():
    student, teacher, labels = _inputs(seed=2)
    values = [generalized_jsd_loss(student, teacher, labels, chunk_size=c) for c in (1, 3, 7, 1000)]
    for v in values[1:]:
        torch.testing.assert_close(v, values[0], atol=1e-12, rtol=0)


def _hand_jsd(p_s: list[float], p_t: list[float], beta: float) -> float:
    m = [beta * t + (1 - beta) * s for s, t in zip(p_s, p_t)]
    kl_t = sum(t * math.log(t / mi) for t, mi in zip(p_t, m) if t > 0)
    kl_s = sum(s * math.log(s / mi) for s, mi in zip(p_s, m) if s > 0)
    return beta * kl_t + (1 - beta) * kl_s


def _softmax(xs: list[float]) -> list[float]:
    mx = max(xs)
    ex = [math.exp(x - mx) for x in xs]
    return [e / sum(ex) for e in ex]


def test_top_k_against_hand_formula():
    s = [[[2.0, 0.5, -1.0, 0.3, 1.2]]]
    t = [[[0.1, 3.0, -2.0, 2.5, 0.0]]]
    student, teacher = torch.tensor(s, dtype=torch.float64), torch.tensor(t, dtype=torch.float64)
    # teacher's top-2 tokens are indices 1 and 3; both distributions renormalised over them
    p_s = _softmax([0.5, 0.3])
    p_t = _softmax([3.0, 2.5])
    expected = _hand_jsd(p_s, p_t, 0.5)
    got = generalized_jsd_loss(student, teacher, beta=0.5, top_k=2, reduction="sum")
    assert float(got) == pytest.approx(expected, abs=1e-12)


def test_token_clip_against_hand_formula():
    student = torch.tensor(
        [[[4.0, 0.0, 0.0], [0.1, 0.0, 0.0]]], dtype=torch.float64, requires_grad=True
    )
    teacher = torch.tensor([[[0.0, 0.0, 4.0], [0.0, 0.1, 0.0]]], dtype=torch.float64)
    raw = [
        _hand_jsd(_softmax([4.0, 0.0, 0.0]), _softmax([0.0, 0.0, 4.0]), 0.5),
        _hand_jsd(_softmax([0.1, 0.0, 0.0]), _softmax([0.0, 0.1, 0.0]), 0.5),
    ]
    clip = 0.05
    assert raw[0] > clip > raw[1]
    got = generalized_jsd_loss(student, teacher, beta=0.5, token_clip=clip, reduction="none")
    torch.testing.assert_close(got[0], torch.tensor([clip, raw[1]], dtype=torch.float64))
    got.sum().backward()
    assert torch.all(student.grad[0, 0] == 0)  # the clamped token gets no gradient
    assert torch.any(student.grad[0, 1] != 0)


def test_logits_are_probs_equals_logits_path():
    student, teacher, labels = _inputs(seed=9)
    p_s, p_t = torch.softmax(student, -1), torch.softmax(teacher, -1)
    for beta in (0.0, 0.5, 1.0):
        from_logits = generalized_jsd_loss(student, teacher, labels, beta=beta, temperature=1.5)
        from_probs = generalized_jsd_loss(
            p_s, p_t, labels, beta=beta, temperature=1.5, logits_are_probs=True
        )
        torch.testing.assert_close(from_probs, from_logits, atol=1e-10, rtol=1e-9)


def test_logits_are_probs_gradient_matches_autograd():
    student, teacher, _ = _inputs(seed=4, T=3, V=5)
    p_s = torch.softmax(student, -1).requires_grad_()
    p_t = torch.softmax(teacher, -1)
    ours = generalized_jsd_loss(p_s, p_t, beta=0.3, logits_are_probs=True)
    ours.backward()
    p_s2 = p_s.detach().clone().requires_grad_()
    log_s, log_t = torch.log_softmax(p_s2.log(), -1), torch.log_softmax(p_t.log(), -1)
    mix = torch.logaddexp(log_s + math.log(0.7), log_t + math.log(0.3))
    ref = (
        0.3 * (log_t.exp() * (log_t - mix)).sum(-1) + 0.7 * (log_s.exp() * (log_s - mix)).sum(-1)
    ).sum() / p_s.shape[0]
    ref.backward()
    torch.testing.assert_close(p_s.grad, p_s2.grad, atol=1e-9, rtol=1e-7)


def test_all_masked_batchmean_is_zero_with_grad():
    student, teacher, labels = _inputs(seed=1)
    student.requires_grad_()
    labels = torch.full_like(labels, -100)
    loss = generalized_jsd_loss(student, teacher, labels)
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert torch.all(student.grad == 0)


def test_identical_distributions_give_zero():
    student, _, labels = _inputs(seed=3)
    for beta in (0.0, 0.5, 1.0):
        assert float(
            generalized_jsd_loss(student, student.clone(), labels, beta=beta)
        ) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"reduction": "avg"}, "reduction"),
        ({"beta": 1.5}, "beta"),
        ({"temperature": 0.0}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"token_clip": -1.0}, "token_clip"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    student, teacher, labels = _inputs(seed=0)
    with pytest.raises(ValueError, match=match):
        generalized_jsd_loss(student, teacher, labels, **kwargs)


def test_shape_mismatches_raise():
    student, teacher, labels = _inputs(seed=0)
    with pytest.raises(ValueError, match="same shape"):
        generalized_jsd_loss(student, teacher[:, :-1], labels)
    with pytest.raises(ValueError, match="labels"):
        generalized_jsd_loss(student, teacher, labels[:, :-1])
    with pytest.raises(ValueError, match="mask"):
        per_token_jsd(student, teacher, labels[:, :-1] != -100)


def test_bfloat16_inputs_computed_in_float32():
    student, teacher, labels = _inputs(seed=6, dtype=torch.float32)
    ref = generalized_jsd_loss(student.bfloat16().float(), teacher.bfloat16().float(), labels)
    s16 = student.bfloat16().requires_grad_()
    got = generalized_jsd_loss(s16, teacher.bfloat16(), labels)
    assert got.dtype == torch.float32
    assert float(got.detach()) == pytest.approx(float(ref), rel=1e-6)
    got.backward()
    assert s16.grad.dtype == torch.bfloat16


def test_second_backward_with_retain_graph_gives_the_same_gradient():
    student, teacher, labels = _inputs(seed=8)
    student.requires_grad_()
    loss = generalized_jsd_loss(student, teacher, labels, beta=0.4, temperature=0.9)
    (first,) = torch.autograd.grad(loss, student, retain_graph=True)
    (second,) = torch.autograd.grad(loss, student)
    torch.testing.assert_close(second, first, atol=1e-12, rtol=0)


def test_no_grad_forward_equals_grad_forward():
    student, teacher, labels = _inputs(seed=10)
    with torch.no_grad():
        plain = generalized_jsd_loss(student, teacher, labels)
    tracked = generalized_jsd_loss(student.clone().requires_grad_(), teacher, labels)
    torch.testing.assert_close(tracked.detach(), plain, atol=0, rtol=0)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_in_place_row_gradient_equals_reference(beta):
    from composer_replication.ops.jsd import (
        jsd_rows_student_grad_,
        jsd_rows_with_grads,
        log_softmax_,
    )

    gen = torch.Generator().manual_seed(1)
    s = torch.randn(5, 11, generator=gen, dtype=torch.float64) * 2
    t = torch.randn(5, 11, generator=gen, dtype=torch.float64) * 2
    s_logp, t_logp = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    ref_jsd, ref_grad, _ = jsd_rows_with_grads(s_logp, t_logp, beta)
    scratch, mix = torch.empty_like(s), torch.empty_like(s)
    s_ip, t_ip = log_softmax_(s.clone(), scratch), log_softmax_(t.clone(), scratch)
    torch.testing.assert_close(s_ip, s_logp, atol=1e-12, rtol=0)
    jsd, grad = jsd_rows_student_grad_(s_ip, t_ip, beta, mix, scratch)
    torch.testing.assert_close(jsd, ref_jsd, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=0)
