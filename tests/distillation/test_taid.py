"""TAID loss and TAIDScheduler, against hand formulas and the upstream SakanaAI/TAID algorithm."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from composer_replication.distillation import TAIDScheduler, taid_loss

STUDENT = [[[1.0, 0.0, -1.0], [0.5, 2.0, -0.5]]]  # (1, 2, 3)
TEACHER = [[[0.0, 2.0, 1.0], [-1.0, 0.0, 3.0]]]


def _softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    exps = [math.exp(x - m) for x in xs]
    return [e / sum(exps) for e in exps]


def _log_softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    lse = m + math.log(sum(math.exp(x - m) for x in xs))
    return [x - lse for x in xs]


def _hand_token_loss(s: list[float], te: list[float], t: float) -> float:
    target = _softmax([(1 - t) * a + t * b for a, b in zip(s, te, strict=True)])
    log_q = _log_softmax(s)
    return -sum(p * lq for p, lq in zip(target, log_q, strict=True))


def _upstream_reference(logits, teacher_logits, mask, t):
    """SakanaAI/TAID ``TAID.compute_loss`` + ``forward_kl``, restated for the comparison."""
    p_t = F.softmax((1 - t) * logits.detach() + t * teacher_logits, dim=-1, dtype=torch.float32)
    student_logprobs = F.log_softmax(logits, dim=-1, dtype=torch.float32)
    prod = torch.masked_fill(p_t * student_logprobs, torch.isinf(logits), 0)
    x = prod.sum(dim=-1).view(-1)
    return -torch.sum(x * mask.view(-1)) / torch.sum(mask.view(-1))


def test_taid_loss_matches_hand_formula():
    student, teacher = torch.tensor(STUDENT), torch.tensor(TEACHER)
    per_token = [_hand_token_loss(STUDENT[0][i], TEACHER[0][i], 0.4) for i in range(2)]
    assert taid_loss(student, teacher, t=0.4).item() == pytest.approx(sum(per_token) / 2, rel=1e-6)
    masked = taid_loss(student, teacher, torch.tensor([[1, 0]]), t=0.4)
    assert masked.item() == pytest.approx(per_token[0], rel=1e-6)
    masked_bool = taid_loss(student, teacher, torch.tensor([[False, True]]), t=0.4)
    assert masked_bool.item() == pytest.approx(per_token[1], rel=1e-6)


def test_taid_loss_matches_upstream_formulation():
    torch.manual_seed(0)
    student = torch.randn(3, 5, 7)
    teacher = torch.randn(3, 5, 7)
    mask = (torch.rand(3, 5) > 0.3).float()
    for t in (0.0, 0.25, 0.4, 0.9, 1.0):
        expected = _upstream_reference(student, teacher, mask, torch.tensor(t))
        torch.testing.assert_close(taid_loss(student, teacher, mask, t=t), expected)


def test_taid_loss_accepts_tensor_t():
    student, teacher = torch.tensor(STUDENT), torch.tensor(TEACHER)
    as_tensor = taid_loss(student, teacher, t=torch.tensor(0.7))
    torch.testing.assert_close(as_tensor, taid_loss(student, teacher, t=0.7))


def test_taid_loss_at_t1_is_cross_entropy_to_teacher():
    torch.manual_seed(1)
    student = torch.randn(2, 4, 6, dtype=torch.float64)
    teacher = torch.randn(2, 4, 6, dtype=torch.float64)
    expected = F.cross_entropy(student.reshape(-1, 6), teacher.softmax(-1).reshape(-1, 6))
    torch.testing.assert_close(taid_loss(student, teacher, t=1.0), expected)


def test_taid_loss_at_t0_is_student_self_cross_entropy_with_zero_gradient():
    torch.manual_seed(2)
    student = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(2, 3, 5, dtype=torch.float64)
    loss = taid_loss(student, teacher, t=0.0)
    (grad,) = torch.autograd.grad(loss, student)

    # The self term H(stopgrad(q), q) = -sum_v stopgrad(q) log q: its value is the student's
    # entropy and its gradient (q - stopgrad(q)) / N vanishes; TAID at t=0 is exactly this term.
    log_q = student.log_softmax(-1)
    self_term = -(log_q.detach().exp() * log_q).sum(-1).mean()
    (self_grad,) = torch.autograd.grad(self_term, student)
    torch.testing.assert_close(loss, self_term)
    torch.testing.assert_close(grad, self_grad)
    torch.testing.assert_close(grad, torch.zeros_like(grad))
    rows = student.detach().reshape(-1, 5).tolist()
    entropy = [-sum(p * math.log(p) for p in _softmax(row)) for row in rows]
    assert loss.item() == pytest.approx(sum(entropy) / 6, rel=1e-12)


def test_taid_loss_gradient_is_student_minus_target_over_n():
    torch.manual_seed(3)
    student = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(2, 3, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]])
    t = 0.4
    taid_loss(student, teacher, mask, t=t).backward()
    with torch.no_grad():
        target = ((1 - t) * student + t * teacher).softmax(-1)
        expected = (student.softmax(-1) - target) * mask.unsqueeze(-1) / 3
    torch.testing.assert_close(student.grad, expected)


def test_taid_loss_gradcheck():
    torch.manual_seed(4)
    student = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    # At t=1 the stop-gradient path is absent, so finite differences in the student logits
    # must agree with autograd.
    assert torch.autograd.gradcheck(lambda s: taid_loss(s, teacher.detach(), mask, t=1.0), student)
    # At interior t the student appears in the target only through stopgrad, which finite
    # differences cannot respect; the teacher path is fully differentiable, so check it there.
    assert torch.autograd.gradcheck(
        lambda te: taid_loss(student.detach(), te, mask, t=0.6), teacher
    )


def test_taid_loss_empty_mask_is_zero_with_gradient():
    student = torch.tensor(STUDENT, requires_grad=True)
    loss = taid_loss(student, torch.tensor(TEACHER), torch.zeros(1, 2), t=0.5)
    assert loss.item() == 0.0
    assert loss.requires_grad
    loss.backward()
    assert torch.equal(student.grad, torch.zeros_like(student))


def test_taid_loss_ignores_minus_inf_vocab_padding():
    torch.manual_seed(5)
    student = torch.randn(1, 3, 4, dtype=torch.float64)
    teacher = torch.randn(1, 3, 4, dtype=torch.float64)
    pad = torch.full((1, 3, 1), float("-inf"), dtype=torch.float64)
    padded_student = torch.cat([student, pad], dim=-1).requires_grad_()
    padded_teacher = torch.cat([teacher, pad], dim=-1)
    for t in (0.0, 0.5, 1.0):
        loss = taid_loss(padded_student, padded_teacher, t=t)
        torch.testing.assert_close(loss, taid_loss(student, teacher, t=t))
        (grad,) = torch.autograd.grad(loss, padded_student)
        assert torch.isfinite(grad).all()


def test_taid_loss_upcasts_low_precision_inputs():
    student = torch.tensor(STUDENT, dtype=torch.bfloat16)
    teacher = torch.tensor(TEACHER, dtype=torch.bfloat16)
    loss = taid_loss(student, teacher, t=0.4)
    assert loss.dtype == torch.float32
    expected = taid_loss(student.float(), teacher.float(), t=0.4)
    torch.testing.assert_close(loss, expected)


def test_taid_loss_rejects_bad_inputs():
    student, teacher = torch.tensor(STUDENT), torch.tensor(TEACHER)
    with pytest.raises(ValueError, match=r"\(1, 2, 3\) and \(1, 2, 4\)"):
        taid_loss(student, torch.zeros(1, 2, 4), t=0.5)
    with pytest.raises(ValueError, match=r"\(B, T, V\)"):
        taid_loss(student[0], teacher[0], t=0.5)
    with pytest.raises(ValueError, match="mask shape"):
        taid_loss(student, teacher, torch.ones(2, 1), t=0.5)
    with pytest.raises(ValueError, match="0/1"):
        taid_loss(student, teacher, torch.tensor([[1, -100]]), t=0.5)
    for bad in (-0.1, 1.5, float("nan"), torch.tensor(2.0)):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            taid_loss(student, teacher, t=bad)
    with pytest.raises(ValueError, match="0-d"):
        taid_loss(student, teacher, t=torch.tensor([0.5]))


# --- TAIDScheduler -------------------------------------------------------------------------


def _reference_schedule(losses, steps, *, n, t_start, t_end, alpha, beta):
    """The upstream update rule in plain float64 Python (first loss only seeds)."""
    t, prev, momentum, ts = t_start, None, 0.0, []
    for loss, step in zip(losses, steps, strict=True):
        if prev is None:
            prev = loss
            ts.append(None)
            continue
        momentum = beta * momentum + (1 - beta) * (prev - loss) / (prev + 1e-15)
        t_linear = t_start + (t_end - t_start) * min(1.0, step / n)
        delta = alpha * (1 / (1 + math.exp(-momentum))) * (1 - t)
        t = min(t_end, max(t_linear, t + delta))
        prev = loss
        ts.append(t)
    return ts


def test_scheduler_first_finite_loss_only_seeds():
    sched = TAIDScheduler(10)
    assert sched.t == pytest.approx(0.4)
    assert sched.update_t(float("nan"), 0) is None
    assert sched.state_dict()["prev_loss"] is None
    assert sched.update_t(torch.tensor(2.0), 1) is None
    assert sched.t == pytest.approx(0.4)
    assert sched.state_dict() == {"t": sched.t, "prev_loss": 2.0, "momentum": 0.0}


def test_scheduler_linear_floor_values():
    sched = TAIDScheduler(4, t_start=0.2, t_end=1.0, alpha=0.0)
    sched.update_t(1.0, 0)
    got = []
    for step in (1, 2, 3, 4, 5):
        sched.update_t(1.0, step)
        got.append(sched.t)
    assert got == pytest.approx([0.4, 0.6, 0.8, 1.0, 1.0], rel=1e-6)
    assert sched.linear_t(2) == pytest.approx(0.6)
    assert sched.linear_t(100) == 1.0


def test_scheduler_adaptive_bump_matches_upstream_rule():
    losses = [2.0, 1.0, 0.5, 0.6, 0.2, 0.1]
    steps = [1, 2, 3, 4, 5, 6]
    kwargs = dict(n=100, t_start=0.4, t_end=0.95, alpha=0.5, beta=0.9)
    expected = _reference_schedule(losses, steps, **kwargs)
    sched = TAIDScheduler(100, t_start=0.4, t_end=0.95, alpha=0.5, beta=0.9)
    deltas, got = [], []
    for loss, step in zip(losses, steps, strict=True):
        deltas.append(sched.update_t(loss, step))
        got.append(sched.t)
    assert deltas[0] is None
    assert got[1:] == pytest.approx(expected[1:], rel=1e-12)
    # Second update by hand: relative change 0.5, momentum 0.05,
    # delta = 0.5 * sigmoid(0.05) * (1 - 0.4) > linear floor 0.4 + 0.55 * 0.02.
    delta = 0.5 * (1 / (1 + math.exp(-0.05))) * 0.6
    assert got[1] == pytest.approx(0.4 + delta, rel=1e-12)
    assert deltas[1].item() == pytest.approx(delta, rel=1e-6)  # upstream returns delta_t
    assert deltas[1].dtype == torch.float32
    assert sched.t == pytest.approx(expected[-1], rel=1e-6)


def test_scheduler_default_hyperparameters_follow_floor_early():
    sched = TAIDScheduler(100)
    sched.update_t(2.0, 0)
    # relative change 0.5 -> momentum 0.005; adaptive step 5e-4 * sigmoid(0.005) * 0.6 is
    # below the floor 0.406, so the floor wins.
    sched.update_t(1.0, 1)
    assert sched.t == pytest.approx(0.406, rel=1e-12)


def test_scheduler_is_monotone_under_rising_losses():
    sched = TAIDScheduler(50, alpha=0.05)
    sched.update_t(0.1, 0)
    previous = sched.t
    for step in range(1, 60):
        sched.update_t(0.1 * 1.2**step, step)
        assert sched.t >= previous
        assert sched.t >= sched.linear_t(step) - 1e-7
        previous = sched.t
    assert sched.state_dict()["momentum"] < 0


def test_scheduler_is_capped_at_t_end():
    sched = TAIDScheduler(1000, t_start=0.5, t_end=0.9, alpha=1.0, beta=0.0)
    sched.update_t(10.0, 0)
    for step in range(1, 200):
        sched.update_t(10.0 / (step + 1), step)
        assert sched.t <= 0.9 + 1e-7
    assert sched.t == pytest.approx(0.9)
    sched.update_t(0.01, 5000)  # past the end of training
    assert sched.t == pytest.approx(0.9)


def test_scheduler_ignores_non_finite_losses():
    sched = TAIDScheduler(10, alpha=0.5)
    sched.update_t(1.0, 0)
    sched.update_t(0.5, 1)
    before = sched.state_dict()
    for bad in (float("nan"), float("inf"), float("-inf"), torch.tensor(float("nan"))):
        assert sched.update_t(bad, 2) is None
        assert sched.state_dict() == before


def test_scheduler_disable_adaptive_is_pure_linear_schedule():
    sched = TAIDScheduler(8, t_start=0.3, t_end=0.9, alpha=1.0, disable_adaptive=True)
    sched.update_t(8.0, 0)
    for step in range(1, 12):
        sched.update_t(8.0 / (step + 1), step)  # falling losses would bump an adaptive t
        assert sched.t == pytest.approx(0.3 + 0.6 * min(1.0, step / 8), rel=1e-12)


def test_scheduler_state_round_trip_continues_identically():
    kwargs = dict(t_start=0.4, t_end=1.0, alpha=0.2, beta=0.9)
    original = TAIDScheduler(20, **kwargs)
    for step, loss in enumerate([3.0, 2.5, 2.2, 2.4, 1.9]):
        original.update_t(loss, step)
    restored = TAIDScheduler(20, **kwargs)
    restored.load_state_dict(original.state_dict())
    assert restored.state_dict() == original.state_dict()
    for step, loss in enumerate([1.7, 1.8, 1.2], start=5):
        assert torch.equal(original.update_t(loss, step), restored.update_t(loss, step))
    assert restored.state_dict() == original.state_dict()

    fresh = TAIDScheduler(20, **kwargs)
    fresh.load_state_dict(TAIDScheduler(20, **kwargs).state_dict())
    assert fresh.update_t(1.0, 1) is None  # an unseeded state stays unseeded


def test_scheduler_update_accepts_graph_tensors_and_rejects_bad_input():
    sched = TAIDScheduler(10)
    x = torch.tensor([2.0], requires_grad=True)
    assert sched.update_t(x * 1.0, 0) is None
    t = sched.update_t(x * 0.5, 1)
    assert not t.requires_grad
    with pytest.raises(ValueError, match="scalar"):
        sched.update_t(torch.ones(2), 2)
    with pytest.raises(ValueError, match="global_step"):
        sched.update_t(1.0, -1)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((0,), {}, "num_train_steps"),
        ((2.5,), {}, "num_train_steps"),
        ((10,), {"t_start": -0.1}, "t_start"),
        ((10,), {"t_start": 0.8, "t_end": 0.6}, "t_start"),
        ((10,), {"t_end": 1.1}, "t_end"),
        ((10,), {"alpha": -1e-3}, "alpha"),
        ((10,), {"beta": 1.0}, "beta"),
        ((10,), {"beta": -0.1}, "beta"),
    ],
)
def test_scheduler_validates_constructor_arguments(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        TAIDScheduler(*args, **kwargs)


def test_scheduler_load_state_dict_validates():
    sched = TAIDScheduler(10, t_end=0.8)
    with pytest.raises(ValueError, match="momentum"):
        sched.load_state_dict({"t": 0.5, "prev_loss": None})
    with pytest.raises(ValueError, match=r"t=0\.9"):
        sched.load_state_dict({"t": 0.9, "prev_loss": None, "momentum": 0.0})
