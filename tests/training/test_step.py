"""The trainer step on the tiny model: values against the naive path, normalisation,
accumulation, and real optimisation steps that lower each component."""

from __future__ import annotations

import copy

import pytest
import torch

from composer_replication.ops.dpo import dpo_loss
from composer_replication.ops.token_losses import ce_loss, rl_loss
from composer_replication.opsd import generalized_jsd_loss
from composer_replication.samples.wire import DPOPairTokens, TrainingSample, pack_samples
from composer_replication.training.step import LossConfig, component_counts, train_step
from composer_replication.training.teachers import TeacherModels


@pytest.fixture(scope="module")
def base_model():
    from composer_replication.model.loading import tiny_model

    return tiny_model(seed=0).double()


@pytest.fixture
def model(base_model):
    m = copy.deepcopy(base_model)
    m.train()
    return m


def _ids(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, 2000, (n,), generator=gen).tolist()


def _rl_sample(seed: int, n_prompt: int = 5, n_completion: int = 7, adv: float = 1.0, **kw):
    ids = _ids(seed, n_prompt + n_completion)
    mask = [0] * n_prompt + [1] * n_completion
    gen = torch.Generator().manual_seed(seed + 100)
    inf = [0.0] * n_prompt + (-torch.rand(n_completion, generator=gen) * 4 - 6).tolist()
    return TrainingSample(ids, mask, inf, advantages=[adv * m for m in mask], **kw)


def _naive_logprobs(model, ids):
    logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_rl_component_equals_naive_formula(model):
    samples = [_rl_sample(1, adv=0.7), _rl_sample(2, n_completion=4, adv=-0.4)]
    metrics = train_step(model, pack_samples(samples, max_tokens=1000, split=None))
    total, count = 0.0, 0
    for s in samples:
        lp = _naive_logprobs(model, s.input_ids)
        # streams travel as float32 on the wire
        part, n = rl_loss(
            lp,
            torch.tensor(s.inference_logprobs[1:]).to(lp.dtype),
            torch.tensor(s.advantages[1:]).to(lp.dtype),
            torch.tensor(s.loss_mask[1:]),
        )
        total, count = total + float(part.detach()), count + int(n)
    assert metrics["tokens/rl"] == count == 11
    assert metrics["loss/rl"] == pytest.approx(total / count, rel=1e-10)
    assert metrics["loss"] == pytest.approx(total / count, rel=1e-10)


def test_explicit_all_ones_rl_stream_equals_absent(model):
    a = _rl_sample(3)
    b = copy.deepcopy(a)
    b.rl_weights = [1.0] * len(b.input_ids)
    m1 = copy.deepcopy(model)
    r1 = train_step(model, pack_samples([a], max_tokens=100, split=None))
    r2 = train_step(m1, pack_samples([b], max_tokens=100, split=None))
    assert r1["loss/rl"] == r2["loss/rl"]
    for (n, g1), g2 in zip(_grads(model).items(), _grads(m1).values()):
        assert torch.equal(g1, g2), n


def test_ce_only_sample_does_not_change_rl_component(model):
    rl = _rl_sample(4)
    ids = _ids(9, 10)
    ce_only = TrainingSample(
        ids, [0] * 4 + [1] * 6, [0.0] * 10, rl_weights=[0.0] * 10, ce_weights=[0.0] * 4 + [1.0] * 6
    )
    alone = train_step(copy.deepcopy(model), pack_samples([rl], max_tokens=1000, split=None))
    mixed = train_step(model, pack_samples([rl, ce_only], max_tokens=1000, split=None))
    assert mixed["loss/rl"] == pytest.approx(alone["loss/rl"], rel=1e-12)
    assert mixed["tokens/rl"] == alone["tokens/rl"]
    lp = _naive_logprobs(model, ids)
    ce, n = ce_loss(lp, torch.tensor(ce_only.ce_weights[1:], dtype=lp.dtype))
    ce = float(ce.detach())
    assert mixed["loss/ce"] == pytest.approx(ce / int(n), rel=1e-10)
    assert mixed["loss"] == pytest.approx(alone["loss/rl"] + ce / int(n), rel=1e-10)


def test_ce_with_label_smoothing_equals_the_smoothed_formula(model):
    """``loss.lm_ce_label_smoothing``: ``(1 - eps) * -lp(target) + eps * mean_v -lp(v)`` per ce
    token (torch's convention), from full logits; weighted ce tokens are refused."""
    ids = _ids(9, 10)
    weights = [0.0] * 4 + [1.0] * 6
    sample = TrainingSample(ids, [0] * 10, [0.0] * 10, rl_weights=[0.0] * 10, ce_weights=weights)
    cfg = LossConfig(lm_ce_label_smoothing=0.2)
    out = train_step(model, pack_samples([sample], max_tokens=1000, split=None), cfg)
    logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
    target = logp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    per_token = -(0.8 * target + 0.2 * logp.mean(-1))
    expected = float((per_token * torch.tensor(weights[1:], dtype=per_token.dtype)).sum() / 6)
    assert out["loss/ce"] == pytest.approx(expected, rel=1e-10)
    halves = TrainingSample(
        ids, [0] * 10, [0.0] * 10, rl_weights=[0.0] * 10, ce_weights=[0.0] * 4 + [0.5] * 6
    )
    with pytest.raises(ValueError, match=r"lm_ce_label_smoothing=0.2 needs ce weights of 0 or 1"):
        train_step(model, pack_samples([halves], max_tokens=1000, split=None), cfg)


def test_overlapping_components_add_gradients(model):
    s = _rl_sample(5)
    both = copy.deepcopy(s)
    both.ce_weights = [float(m) for m in s.loss_mask]
    ce_only = copy.deepcopy(both)
    ce_only.rl_weights = [0.0] * len(s.input_ids)
    ce_only.advantages = None
    m_rl, m_ce, m_both = (copy.deepcopy(model) for _ in range(3))
    train_step(m_rl, pack_samples([s], max_tokens=100, split=None))
    train_step(m_ce, pack_samples([ce_only], max_tokens=100, split=None))
    train_step(m_both, pack_samples([both], max_tokens=100, split=None))
    # LlamaRMSNorm computes in float32 even in a float64 model: hence the 1e-7 tolerance
    for name, g in _grads(m_both).items():
        torch.testing.assert_close(g, _grads(m_rl)[name] + _grads(m_ce)[name], atol=1e-7, rtol=1e-5)


def test_all_empty_micro_batch_returns_zero_that_backpropagates(model):
    ids = _ids(6, 8)
    empty = TrainingSample(ids, [0] * 8, [0.0] * 8, rl_weights=[0.0] * 8)
    metrics = train_step(model, pack_samples([empty], max_tokens=100, split=None))
    assert metrics["loss"] == 0.0 and metrics["tokens/rl"] == 0
    grads = _grads(model)
    assert grads, "backward must run (every rank joins the all-reduce)"
    assert all(torch.all(g == 0) for g in grads.values())


def test_gradient_accumulation_equals_one_big_batch(model):
    samples = [_rl_sample(i, n_completion=3 + i, adv=(-1) ** i * 0.5) for i in range(4)]
    for s in samples[:2]:
        s.ce_weights = [0.5 * m for m in s.loss_mask]
    one = pack_samples(samples, max_tokens=10_000, split=None)
    many = pack_samples(samples, max_tokens=20, split=None)
    assert len(one) == 1 and len(many) >= 3
    m_one = copy.deepcopy(model)
    r_one = train_step(m_one, one)
    r_many = train_step(model, many)
    assert r_many["loss"] == pytest.approx(r_one["loss"], rel=1e-10)
    for name, g in _grads(m_one).items():  # float32 RMSNorm inside: 1e-7
        torch.testing.assert_close(_grads(model)[name], g, atol=1e-7, rtol=1e-5)


def _jsd_sample(seed: int, hint_len: int = 3) -> TrainingSample:
    s = _rl_sample(seed)
    prompt, completion = s.input_ids[:5], s.input_ids[5:]
    teacher = [*prompt, *_ids(seed + 50, hint_len), *completion]
    index = [-1] * 5 + [5 + hint_len + k for k in range(len(completion))]
    s.jsd_weights = [0.0] * 5 + [0.1] * len(completion)
    s.teacher_input_ids, s.teacher_index = teacher, index
    return s


def test_jsd_component_equals_full_logits_jsd(model):
    s = _jsd_sample(7)
    s.rl_weights = [0.0] * len(s.input_ids)
    s.advantages = None
    cfg = LossConfig(sdpo_jsd_beta=0.3, sdpo_temperature=0.8)
    metrics = train_step(model, pack_samples([s], max_tokens=100, split=None), cfg)
    student = model(input_ids=torch.tensor([s.input_ids])).logits[0]
    with torch.no_grad():
        teacher = model(input_ids=torch.tensor([s.teacher_input_ids])).logits[0]
    pos = [p for p, w in enumerate(s.jsd_weights) if w]
    tpos = [s.teacher_index[p] for p in pos]
    per_token = generalized_jsd_loss(
        student[[p - 1 for p in pos]][None],
        teacher[[t - 1 for t in tpos]][None],
        beta=0.3,
        temperature=0.8,
        reduction="none",
    )[0]
    expected = float((torch.tensor(0.1).double() * per_token).sum().detach()) / len(pos)
    assert metrics["tokens/jsd"] == len(pos)
    assert metrics["loss/jsd"] == pytest.approx(expected, rel=1e-10)


def _pair(seed: int, weight: float = 1.0) -> DPOPairTokens:
    prompt = _ids(seed, 4)
    chosen, rejected = _ids(seed + 1, 5), _ids(seed + 2, 3)
    return DPOPairTokens(
        [*prompt, *chosen],
        [0] * 4 + [1] * 5,
        [*prompt, *rejected],
        [0] * 4 + [1] * 3,
        weight=weight,
    )


def test_dpo_component_uses_cached_reference(model):
    teachers = TeacherModels(model, mode="policy")
    with torch.no_grad():  # move the policy away from its reference
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    pairs = [_pair(20, 1.0), _pair(30, 0.5)]
    pair_only = [TrainingSample([], [], [], dpo=p) for p in pairs]
    metrics = train_step(
        model,
        pack_samples(pair_only, max_tokens=100, split=None),
        LossConfig(replay_dpo_beta=0.2),
        reference=teachers.reference,
    )
    assert all(p.ref_chosen_logp is not None for p in pairs)

    def seq(m, ids, mask):
        lp = _naive_logprobs(m, ids)
        return (lp * torch.tensor(mask[1:], dtype=lp.dtype)).sum()

    pol_c = torch.stack([seq(model, p.chosen_ids, p.chosen_mask) for p in pairs])
    pol_r = torch.stack([seq(model, p.rejected_ids, p.rejected_mask) for p in pairs])
    with torch.no_grad():
        ref_c = torch.stack([seq(teachers.reference, p.chosen_ids, p.chosen_mask) for p in pairs])
        ref_r = torch.stack(
            [seq(teachers.reference, p.rejected_ids, p.rejected_mask) for p in pairs]
        )
    torch.testing.assert_close(
        torch.tensor([p.ref_chosen_logp for p in pairs], dtype=ref_c.dtype), ref_c
    )
    per_pair = dpo_loss(pol_c, pol_r, ref_c, ref_r, beta=0.2, reduction="none")
    expected = float((torch.tensor([1.0, 0.5], dtype=per_pair.dtype) * per_pair).sum().detach()) / 2
    assert metrics["tokens/dpo"] == 2
    assert metrics["loss/dpo"] == pytest.approx(expected, rel=1e-9)
    with pytest.raises(ValueError, match="reference"):
        train_step(model, pack_samples([TrainingSample([], [], [], dpo=_pair(40))], max_tokens=10))


def _optimise(model, samples, steps=8, lr=3e-3, cfg=None, **kw):
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    history = []
    for _ in range(steps):
        opt.zero_grad()
        history.append(
            train_step(model, pack_samples(samples, max_tokens=1000, split=None), cfg, **kw)
        )
        opt.step()
    return history


def test_steps_lower_ce(model):
    ids = _ids(11, 12)
    s = TrainingSample(
        ids, [0] * 4 + [1] * 8, [0.0] * 12, rl_weights=[0.0] * 12, ce_weights=[0.0] * 4 + [1.0] * 8
    )
    hist = _optimise(model, [s], steps=10, lr=1e-2)
    assert hist[-1]["loss/ce"] < 0.5 * hist[0]["loss/ce"]


def test_steps_raise_logprob_of_rewarded_completion(model):
    good, bad = _rl_sample(12, adv=1.0), _rl_sample(13, adv=-1.0)
    before_good = float(_naive_logprobs(model, good.input_ids)[4:].sum().detach())
    before_bad = float(_naive_logprobs(model, bad.input_ids)[4:].sum().detach())
    for s in (good, bad):  # on-policy: the sampler's log-probs are the model's own
        s.inference_logprobs = [0.0] * 5 + _naive_logprobs(model, s.input_ids)[4:].detach().tolist()
    _optimise(model, [good, bad], steps=5, lr=1e-3)
    assert float(_naive_logprobs(model, good.input_ids)[4:].sum()) > before_good
    assert float(_naive_logprobs(model, bad.input_ids)[4:].sum()) < before_bad


def test_steps_lower_jsd_with_frozen_initial_teacher(model):
    s = _jsd_sample(14)
    s.rl_weights, s.advantages = [0.0] * len(s.input_ids), None
    teachers = TeacherModels(model, mode="initial")
    hist = _optimise(model, [s], teacher=teachers.teacher(model))
    assert hist[-1]["loss/jsd"] < 0.5 * hist[0]["loss/jsd"]


def test_steps_lower_dpo(model):
    teachers = TeacherModels(model)
    pairs = [TrainingSample([], [], [], dpo=_pair(50)), TrainingSample([], [], [], dpo=_pair(60))]
    hist = _optimise(
        model, pairs, reference=teachers.reference, cfg=LossConfig(replay_dpo_beta=0.5)
    )
    assert hist[0]["loss/dpo"] == pytest.approx(0.6931471805599453, rel=1e-9)  # log 2 at start
    assert hist[-1]["loss/dpo"] < 0.5 * hist[0]["loss/dpo"]


def test_steps_lower_ref_kl_towards_reference(model):
    s = _rl_sample(15)
    lp = _naive_logprobs(model, s.input_ids).detach()
    s.inference_logprobs = [0.0, *lp.tolist()]
    s.rl_weights, s.advantages = [0.0] * len(s.input_ids), None
    s.ref_kl_weights = [float(m) for m in s.loss_mask]
    s.ref_logprobs = [
        0.0,
        *(lp + 1.0).clamp(max=-0.01).tolist(),
    ]  # a reference that likes them more
    before = float(_naive_logprobs(model, s.input_ids)[4:].sum().detach())
    _optimise(model, [s], steps=5, lr=1e-3)
    assert float(_naive_logprobs(model, s.input_ids)[4:].sum()) > before


def test_ema_teacher_moves_towards_policy(model):
    teachers = TeacherModels(model, mode="ema", ema_decay=0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    teachers.update(model)
    for (_, p), (_, e) in zip(model.named_parameters(), teachers.ema.named_parameters()):
        torch.testing.assert_close(e, p - 0.5, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="teacher mode"):
        TeacherModels(model, mode="best")


def test_component_counts_and_config_validation():
    samples = [_rl_sample(1), _rl_sample(2, n_completion=3)]
    counts = component_counts(pack_samples(samples, max_tokens=1000, split=None))
    assert counts == {"rl": 10, "ce": 0, "ref_kl": 0, "jsd": 0, "dpo": 0}
    with pytest.raises(ValueError):
        LossConfig(mask_low=-1)
    with pytest.raises(ValueError, match="unknown components"):
        LossConfig(coefficients={"kl": 1.0}).coefficient("rl")


def test_lora_initial_policy_is_the_adapter_free_base(base_model):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from composer_replication.model.parts import AdapterDisabled, last_hidden_states
    from composer_replication.training.setup import kl_to_initial, kl_to_initial_sum

    original = copy.deepcopy(base_model).eval()
    policy = get_peft_model(
        copy.deepcopy(base_model),
        PeftLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    teachers = TeacherModels(policy, mode="initial")
    assert isinstance(teachers.initial, AdapterDisabled)  # no second copy of the weights
    assert teachers.teacher(policy) is teachers.reference is teachers.initial
    ids = torch.tensor([_ids(70, 12)])
    attn = torch.ones_like(ids)
    batches = pack_samples([_rl_sample(70)], max_tokens=64)
    assert kl_to_initial(policy, teachers.initial, batches, 1.0) == pytest.approx(0.0, abs=1e-12)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
        want = last_hidden_states(original, ids, attn)
        got = last_hidden_states(teachers.initial, ids, attn)
        moved = last_hidden_states(policy, ids, attn)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    assert not torch.allclose(moved, want)  # the adapters are back on after the view's forward
    grad_modes = []  # a measurement builds no graph
    layer = next(m for name, m in policy.named_modules() if name.endswith("layers.0"))
    hook = layer.register_forward_pre_hook(lambda *_: grad_modes.append(torch.is_grad_enabled()))
    try:
        total, count = kl_to_initial_sum(policy, teachers.initial, batches, 1.0)
    finally:
        hook.remove()
    assert total / count == pytest.approx(kl_to_initial(policy, teachers.initial, batches, 1.0))
    assert total / count > 1e-4
    assert grad_modes and not any(grad_modes)
    # A policy with trainable non-LoRA weights gets a real frozen copy.
    full = TeacherModels(copy.deepcopy(base_model))
    assert not isinstance(full.initial, AdapterDisabled)


def test_kl_to_initial_is_the_exact_token_mean_kl(base_model):
    from composer_replication.training.setup import kl_to_initial

    policy = copy.deepcopy(base_model)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    samples = [_rl_sample(80), _rl_sample(81, n_completion=4)]
    batches = pack_samples(samples, max_tokens=64, split=None)
    got = kl_to_initial(policy, base_model, batches, 0.7)
    total, count = 0.0, 0
    for s in samples:
        ids = torch.tensor([s.input_ids])
        with torch.no_grad():
            lp = torch.log_softmax(policy(input_ids=ids).logits[0, :-1] / 0.7, -1)
            lq = torch.log_softmax(base_model(input_ids=ids).logits[0, :-1] / 0.7, -1)
        kl = (lp.exp() * (lp - lq)).sum(-1)
        mask = torch.tensor(s.loss_mask[1:], dtype=torch.bool)
        total += float(kl[mask].sum())
        count += int(mask.sum())
    assert got == pytest.approx(total / count, rel=1e-9)
    assert got > 0
