"""Chunked hidden-state head ops equal the naive full-logits path (values and gradients)."""

from __future__ import annotations

import pytest
import torch

from composer_replication.model.parts import last_hidden_states, lm_head_weight
from composer_replication.ops import (
    cross_entropy_from_hidden,
    jsd_from_hidden,
    token_logprobs_from_hidden,
)
from composer_replication.opsd import generalized_jsd_loss


def _setup(dtype=torch.float64, B=3, T=7, H=8, V=19, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=gen, dtype=dtype).requires_grad_()
    weight = torch.randn(V, H, generator=gen, dtype=dtype).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=gen)
    targets[0, :3] = -100
    return hidden, weight, targets


def _naive_logprobs(hidden, weight, targets, temperature=1.0):
    logp = torch.log_softmax(hidden @ weight.T / temperature, dim=-1)
    picked = logp.gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1)
    return picked * (targets != -100), -(logp.exp() * logp).sum(-1) * (targets != -100)


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [1, 4, 100])
@pytest.mark.parametrize("head_grad", [True, False])
def test_token_logprobs_equal_naive(temperature, chunk, head_grad):
    hidden, weight, targets = _setup()
    weight.requires_grad_(head_grad)
    upstream = torch.randn(targets.shape, dtype=torch.float64)
    lp, ent = token_logprobs_from_hidden(
        hidden, weight, targets, temperature=temperature, chunk_size=chunk, return_entropy=True
    )
    ref_lp, ref_ent = _naive_logprobs(hidden, weight, targets, temperature)
    torch.testing.assert_close(lp, ref_lp, atol=1e-11, rtol=1e-10)
    torch.testing.assert_close(ent, ref_ent, atol=1e-11, rtol=1e-10)
    assert not ent.requires_grad
    inputs = (hidden, weight) if head_grad else (hidden,)
    ours = _grads((lp * upstream).sum(), *inputs)
    ref = _grads((ref_lp * upstream).sum(), *inputs)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-10)


def test_token_logprobs_float32_close_to_naive():
    hidden, weight, targets = _setup(dtype=torch.float32, V=301, H=32, T=40)
    lp = token_logprobs_from_hidden(hidden, weight, targets, chunk_size=16)
    ref, _ = _naive_logprobs(hidden, weight, targets)
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)


def test_cross_entropy_equals_torch():
    hidden, weight, targets = _setup()
    ours = cross_entropy_from_hidden(hidden, weight, targets, chunk_size=5)
    ref = torch.nn.functional.cross_entropy(
        (hidden @ weight.T).reshape(-1, weight.shape[0]), targets.reshape(-1)
    )
    torch.testing.assert_close(ours, ref, atol=1e-12, rtol=1e-10)
    for a, b in zip(_grads(ours, hidden, weight), _grads(ref, hidden, weight)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    total = cross_entropy_from_hidden(hidden, weight, targets, reduction="sum")
    n = int((targets != -100).sum())
    torch.testing.assert_close(total / n, ours)
    per_token = cross_entropy_from_hidden(hidden, weight, targets, reduction="none")
    assert per_token.shape == targets.shape and torch.all(per_token[targets == -100] == 0)


def test_cross_entropy_all_ignored_is_zero_with_grad():
    hidden, weight, targets = _setup()
    loss = cross_entropy_from_hidden(hidden, weight, torch.full_like(targets, -100))
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert torch.all(hidden.grad == 0)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("head_grad", [True, False])
def test_jsd_from_hidden_equals_logits_path(beta, head_grad):
    hidden, weight, targets = _setup()
    weight.requires_grad_(head_grad)
    gen = torch.Generator().manual_seed(3)
    t_hidden = torch.randn(hidden.shape, generator=gen, dtype=torch.float64)
    t_weight = torch.randn(weight.shape, generator=gen, dtype=torch.float64)
    mask = targets != -100
    upstream = torch.randn(targets.shape, dtype=torch.float64)
    ours = jsd_from_hidden(
        hidden,
        weight,
        t_hidden,
        teacher_weight=t_weight,
        mask=mask,
        beta=beta,
        temperature=0.8,
        chunk_size=3,
    )
    ref = generalized_jsd_loss(
        hidden @ weight.T,
        t_hidden @ t_weight.T,
        targets,
        beta=beta,
        temperature=0.8,
        reduction="none",
    )
    torch.testing.assert_close(ours, ref, atol=1e-11, rtol=1e-10)
    inputs = (hidden, weight) if head_grad else (hidden,)
    for a, b in zip(
        _grads((ours * upstream).sum(), *inputs), _grads((ref * upstream).sum(), *inputs)
    ):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-10)


def test_jsd_teacher_side_gets_no_gradient():
    hidden, weight, _ = _setup()
    t_hidden = torch.randn(hidden.shape, dtype=torch.float64, requires_grad=True)
    out = jsd_from_hidden(hidden, weight, t_hidden)
    out.sum().backward()
    assert t_hidden.grad is None
    assert hidden.grad is not None and torch.any(hidden.grad != 0)


def test_bad_inputs_raise():
    hidden, weight, targets = _setup()
    with pytest.raises(ValueError, match="hidden size"):
        token_logprobs_from_hidden(hidden, weight[:, :-1], targets)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs_from_hidden(hidden, weight, targets[:, :-1])
    with pytest.raises(ValueError, match="token ids"):
        token_logprobs_from_hidden(hidden, weight, targets + weight.shape[0] + 200)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_from_hidden(hidden, weight, targets, temperature=0)
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy_from_hidden(hidden, weight, targets, reduction="avg")
    with pytest.raises(ValueError, match="teacher_hidden"):
        jsd_from_hidden(hidden, weight, hidden[:, :-1].detach())
    with pytest.raises(ValueError, match="beta"):
        jsd_from_hidden(hidden, weight, hidden.detach(), beta=2.0)


def test_tiny_model_hidden_path_equals_model_logits():
    from composer_replication.model.loading import tiny_model

    model = tiny_model(seed=1).double()
    ids = torch.randint(
        0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)
    )
    attn = torch.ones_like(ids)
    logits = model(input_ids=ids, attention_mask=attn).logits
    hidden = last_hidden_states(model, ids, attn)
    weight = lm_head_weight(model)
    torch.testing.assert_close(hidden @ weight.T, logits, atol=1e-10, rtol=1e-9)
    targets = ids[:, 1:]
    ours = token_logprobs_from_hidden(hidden[:, :-1], weight, targets, chunk_size=5).sum()
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, targets[..., None]).sum()
    torch.testing.assert_close(ours, ref, atol=1e-9, rtol=1e-9)
    params = [p for p in model.parameters() if p.requires_grad]
    for a, b in zip(torch.autograd.grad(ours, params), torch.autograd.grad(ref, params)):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("head_grad", [True, False])
def test_fused_cross_entropy_equals_torch_with_temperature(temperature, head_grad):
    hidden, weight, targets = _setup(seed=4)
    weight.requires_grad_(head_grad)
    ours = cross_entropy_from_hidden(hidden, weight, targets, temperature=temperature, chunk_size=4)
    logits = (hidden @ weight.T / temperature).reshape(-1, weight.shape[0])
    ref = torch.nn.functional.cross_entropy(logits, targets.reshape(-1))
    torch.testing.assert_close(ours, ref, atol=1e-12, rtol=1e-10)
    inputs = (hidden, weight) if head_grad else (hidden,)
    for a, b in zip(_grads(3.0 * ours, *inputs), _grads(3.0 * ref, *inputs)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    with torch.no_grad():
        plain = cross_entropy_from_hidden(hidden, weight, targets, temperature=temperature)
    torch.testing.assert_close(plain, ref.detach(), atol=1e-12, rtol=1e-10)
