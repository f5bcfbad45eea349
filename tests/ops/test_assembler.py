"""The loss assembler's rl component: the default DPPO loss or a custom one by import path."""

from __future__ import annotations

import copy
import textwrap

import pytest
import torch

from composer_replication.config.loss import LossConfig
from composer_replication.ops.assembler import micro_batch_losses, rl_loss_of
from composer_replication.samples.wire import TrainingSample, pack_samples
from composer_replication.training.step import train_step

CUSTOM = '''
import torch

def reinforce(logprobs, inference_logprobs, advantages, loss_mask, weights, *, scale=1.0):
    """Plain REINFORCE: -scale * A * lp on the trainable weighted tokens."""
    live = (loss_mask != 0).to(logprobs.dtype) * weights.to(logprobs.dtype)
    return -(scale * advantages * logprobs * live).sum()

def with_count(logprobs, inference_logprobs, advantages, loss_mask, weights):
    return reinforce(logprobs, inference_logprobs, advantages, loss_mask, weights), 123

def per_token(logprobs, inference_logprobs, advantages, loss_mask, weights):
    return -(advantages * logprobs)
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_rl_losses.py").write_text(textwrap.dedent(CUSTOM))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_rl_losses"


@pytest.fixture(scope="module")
def policy():
    from composer_replication.model.loading import tiny_model

    return tiny_model(seed=0).double().train()


def _samples():
    gen = torch.Generator().manual_seed(3)
    out = []
    for adv in (1.0, -0.5):
        ids = torch.randint(10, 2000, (12,), generator=gen).tolist()
        mask = [0] * 5 + [1] * 7
        inf = [0.0] * 5 + (-torch.rand(7, generator=gen) * 3 - 5).tolist()
        out.append(TrainingSample(ids, mask, inf, advantages=[adv * m for m in mask]))
    return out


def _custom(module: str, fn: str = "reinforce", **kwargs) -> LossConfig:
    return LossConfig(type="custom", import_path=f"{module}:{fn}", kwargs=kwargs)


def test_a_custom_rl_loss_is_divided_by_the_packed_rl_count(policy, user_module):
    samples = _samples()
    out = train_step(
        copy.deepcopy(policy),
        pack_samples(samples, max_tokens=1000, split=None),
        _custom(user_module, scale=2.0),
    )
    expected, count = 0.0, 0
    for s in samples:
        logits = policy(input_ids=torch.tensor([s.input_ids])).logits[0, :-1]
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.input_ids[1:])[:, None])
        live = torch.tensor(s.loss_mask[1:], dtype=torch.float64)
        adv = torch.tensor(s.advantages[1:], dtype=torch.float64)
        expected += float(-(2.0 * adv * lp.squeeze(-1) * live).sum())
        count += int(live.sum())
    assert out["tokens/rl"] == count == 14
    assert out["loss/rl"] == pytest.approx(expected / count, rel=1e-10)


def test_a_tuple_result_uses_its_sum_and_the_packed_count(policy, user_module):
    batches = pack_samples(_samples(), max_tokens=1000, split=None)
    plain = train_step(copy.deepcopy(policy), batches, _custom(user_module))
    paired = train_step(copy.deepcopy(policy), batches, _custom(user_module, "with_count"))
    assert paired["loss/rl"] == pytest.approx(plain["loss/rl"], rel=1e-12)
    assert paired["tokens/rl"] == plain["tokens/rl"] == 14


def test_the_default_rl_loss_as_a_custom_one_gives_the_same_gradients(policy):
    batches = pack_samples(_samples(), max_tokens=1000, split=None)
    grads = []
    for cfg in (
        LossConfig(kl_tau=0.05),
        LossConfig(
            type="custom",
            import_path="composer_replication.ops.token_losses:rl_loss",
            kwargs={"kl_tau": 0.05},
        ),
    ):
        model = copy.deepcopy(policy)
        train_step(model, batches, cfg)
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_a_custom_rl_loss_that_returns_per_token_values_is_refused(policy, user_module):
    (mb,) = pack_samples(_samples(), max_tokens=1000, split=None)
    with pytest.raises(ValueError, match=r"user_rl_losses:per_token.*0-d tensor"):
        micro_batch_losses(policy, mb, _custom(user_module, "per_token"))


def test_custom_rl_loss_settings_are_checked_when_parsed():
    with pytest.raises(ValueError, match=r"needs loss\.import_path"):
        LossConfig(type="custom")
    with pytest.raises(ValueError, match=r"loss\.type = 'default'"):
        LossConfig(import_path="pkg.mod:fn")
    with pytest.raises(ValueError, match="import_path"):
        LossConfig(type="custom", import_path="not a path")
    with pytest.raises(ValueError, match=r"cannot import 'no_such_module_x:fn'"):
        rl_loss_of(LossConfig(type="custom", import_path="no_such_module_x:fn"))
