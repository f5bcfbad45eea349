"""The PRIME-RL custom loss: formula, both calling forms, gradients, validation, the
reference-KL term, per-component normalisation and import-path resolution."""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

import pytest
import torch

from composer_replication.ops.token_losses import ref_kl_loss, rl_loss
from composer_replication.recipes.prime_rl import composer_loss
from composer_replication.recipes.prime_rl.composer_loss import (
    IMPORT_PATH,
    LossOutputs,
    loss_fn,
    prime_rl_loss,
)


@dataclass
class Inputs:
    """Stand-in with the attributes of PRIME-RL's LossInputs (duck-typed)."""

    trainer_logprobs: torch.Tensor
    inference_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    loss_weights: torch.Tensor | None = None


@dataclass
class SeedInputs:
    trainer_logprobs: torch.Tensor
    inference_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    teacher_logprobs: torch.Tensor | None = None


def _sample(n: int = 64, seed: int = 0, dtype=torch.float64, weights: bool = False) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(n, generator=g, dtype=dtype) * 0.95 + 0.05
    # Sampler probabilities near the trainer's, some far enough to cross the trust region.
    p_inf = (p + torch.randn(n, generator=g, dtype=dtype) * 0.25).clamp(0.01, 1.0)
    lp, lp_inf = p.log(), p_inf.log()
    ref = lp + torch.randn(n, generator=g, dtype=dtype) * 0.5
    adv = torch.randn(n, generator=g, dtype=dtype)
    adv[::7] = 0.0
    mask = torch.rand(n, generator=g) > 0.25
    w = torch.rand(n, generator=g, dtype=dtype) * 2 if weights else None
    return Inputs(lp.requires_grad_(), lp_inf, ref, adv, mask, w)


def _detached(x: Inputs) -> Inputs:
    return Inputs(
        x.trainer_logprobs.detach(),
        x.inference_logprobs,
        x.ref_logprobs,
        x.advantages,
        x.loss_mask,
        x.loss_weights,
    )


def _reference_loss(x: Inputs, alpha=0.0, high=0.2, low=0.2, adv_tau=1.0, kl_tau=1e-3) -> float:
    """The formula, token by token in Python floats (float64)."""
    x = _detached(x)
    total = 0.0
    for i in range(x.trainer_logprobs.shape[0]):
        if not bool(x.loss_mask[i]):
            continue
        lp = float(x.trainer_logprobs[i])
        lpi = float(x.inference_logprobs[i])
        a = float(x.advantages[i])
        w = 1.0 if x.loss_weights is None else float(x.loss_weights[i])
        dp = math.exp(lp) - math.exp(lpi)
        dropped = (a > 0 and dp > high) or (a < 0 and dp < -low)
        r = math.exp(lp - lpi)
        term = -(0.0 if dropped else adv_tau * a * r) + kl_tau * (lp - lpi) ** 2
        if alpha > 0:
            keep_ref = not dp < -low
            signal = float(x.ref_logprobs[i]) - lp
            term += alpha * (-(signal * r if keep_ref else 0.0) + kl_tau * (lp - lpi) ** 2)
        total += w * term
    return total


def _reference_grad(x: Inputs, alpha=0.0, high=0.2, low=0.2, adv_tau=1.0, kl_tau=1e-3):
    """d loss / d lp per token, by hand (the trust-region masks and the signal are constants)."""
    x = _detached(x)
    out = []
    for i in range(x.trainer_logprobs.shape[0]):
        if not bool(x.loss_mask[i]):
            out.append(0.0)
            continue
        lp = float(x.trainer_logprobs[i])
        lpi = float(x.inference_logprobs[i])
        a = float(x.advantages[i])
        w = 1.0 if x.loss_weights is None else float(x.loss_weights[i])
        dp = math.exp(lp) - math.exp(lpi)
        dropped = (a > 0 and dp > high) or (a < 0 and dp < -low)
        r = math.exp(lp - lpi)
        g = -(0.0 if dropped else adv_tau * a * r) + 2 * kl_tau * (lp - lpi)
        if alpha > 0:
            signal = float(x.ref_logprobs[i]) - lp
            g += alpha * (-(0.0 if dp < -low else signal * r) + 2 * kl_tau * (lp - lpi))
        out.append(w * g)
    return torch.tensor(out, dtype=torch.float64)


KNOB_SETS = [
    {},
    {"dppo_mask_high": 0.05, "dppo_mask_low": 0.1, "adv_tau": 0.5, "kl_tau": 0.01},
    {"alpha_sdpo": 0.3},
    {"alpha_sdpo": 1.0, "dppo_mask_low": 0.05, "kl_tau": 0.0},
]


def _ref_kwargs(knobs: dict) -> dict:
    return {
        "alpha": knobs.get("alpha_sdpo", 0.0),
        "high": knobs.get("dppo_mask_high", 0.2),
        "low": knobs.get("dppo_mask_low", 0.2),
        "adv_tau": knobs.get("adv_tau", 1.0),
        "kl_tau": knobs.get("kl_tau", 1e-3),
    }


@pytest.mark.parametrize("knobs", KNOB_SETS)
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_both_forms_equal_the_token_loop_and_its_gradient(knobs, weights, seed):
    x = _sample(seed=seed, weights=weights)
    expected = _reference_loss(x, **_ref_kwargs(knobs))
    out = prime_rl_loss(x, **knobs)
    assert isinstance(out, LossOutputs)
    torch.testing.assert_close(
        out.loss, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12
    )
    seed_value = loss_fn(x, **knobs)
    torch.testing.assert_close(seed_value, out.loss, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(seed_value, x.trainer_logprobs)
    torch.testing.assert_close(
        grad, _reference_grad(x, **_ref_kwargs(knobs)), rtol=1e-12, atol=1e-12
    )


def test_the_sample_crosses_both_sides_of_the_trust_region():
    # Otherwise the formula test would not exercise the drop rule.
    x = _sample(seed=0)
    metrics = prime_rl_loss(x).metrics
    assert 0 < float(metrics["is_masked_high"]) < 1
    assert 0 < float(metrics["is_masked_low"]) < 1


def test_small_hand_computed_values():
    lp = torch.log(torch.tensor([0.5, 0.9, 0.2, 0.4], dtype=torch.float64))
    lp_inf = torch.log(torch.tensor([0.4, 0.5, 0.6, 0.4], dtype=torch.float64))
    adv = torch.tensor([1.0, 2.0, -1.0, 3.0], dtype=torch.float64)
    mask = torch.tensor([True, True, True, False])
    x = SeedInputs(lp, lp_inf, adv, mask)
    # Token 0: dp = 0.1, kept: -1 * 1.25 + 1e-3 * log(1.25)^2.
    # Token 1: A > 0 and dp = 0.4 > 0.2: dropped, only the kl term 1e-3 * log(1.8)^2.
    # Token 2: A < 0 and dp = -0.4 < -0.2: dropped, 1e-3 * log(1/3)^2. Token 3: masked out.
    expected = -1.25 + 1e-3 * (math.log(1.25) ** 2 + math.log(1.8) ** 2 + math.log(1 / 3) ** 2)
    torch.testing.assert_close(loss_fn(x), torch.tensor(expected, dtype=torch.float64))
    metrics = prime_rl_loss(x).metrics
    torch.testing.assert_close(metrics["is_masked"], torch.tensor(2 / 3, dtype=torch.float64))
    torch.testing.assert_close(metrics["is_masked_high"], torch.tensor(1 / 3, dtype=torch.float64))
    torch.testing.assert_close(metrics["is_masked_low"], torch.tensor(1 / 3, dtype=torch.float64))
    # a zero advantage is on the keep mask's low side: the metrics count it there too
    zero = SeedInputs(lp, lp_inf, torch.tensor([1.0, 2.0, 0.0, 3.0], dtype=torch.float64), mask)
    zero_metrics = prime_rl_loss(zero).metrics
    torch.testing.assert_close(zero_metrics["is_masked_low"], metrics["is_masked_low"])
    torch.testing.assert_close(
        zero_metrics["is_masked"],
        zero_metrics["is_masked_high"] + zero_metrics["is_masked_low"],
    )
    mkl0 = 1.25 - math.log(1.25) - 1
    torch.testing.assert_close(
        metrics["unmasked_mismatch_kl"], torch.tensor(mkl0, dtype=torch.float64)
    )
    # alpha_sdpo with a teacher: token 0 adds -(log 0.7 - log 0.5) * 1.25 + kl; token 2 is
    # outside the one-sided region (dp < -0.2) and adds only its kl term.
    teacher = torch.log(torch.tensor([0.7, 0.9, 0.1, 0.3], dtype=torch.float64))
    x = SeedInputs(lp, lp_inf, adv, mask, teacher_logprobs=teacher)
    ref_term = -(math.log(0.7) - math.log(0.5)) * 1.25 + 1e-3 * (
        math.log(1.25) ** 2 + math.log(1.8) ** 2 + math.log(1 / 3) ** 2
    )
    torch.testing.assert_close(
        loss_fn(x, alpha_sdpo=0.5), torch.tensor(expected + 0.5 * ref_term, dtype=torch.float64)
    )


@pytest.mark.parametrize("weights", [False, True])
def test_alpha_term_equals_our_ref_kl_component(weights):
    x = _sample(seed=3, weights=weights)
    base = loss_fn(x)
    with_ref = loss_fn(x, alpha_sdpo=0.7)
    ours, _ = ref_kl_loss(
        x.trainer_logprobs, x.inference_logprobs, x.ref_logprobs, x.loss_mask, x.loss_weights
    )
    torch.testing.assert_close(with_ref - base, 0.7 * ours, rtol=1e-12, atol=1e-12)
    metrics = prime_rl_loss(x, alpha_sdpo=0.7).metrics
    tokens = x.loss_mask if x.loss_weights is None else x.loss_mask & (x.loss_weights != 0)
    expected_ref_kl = (x.ref_logprobs - x.trainer_logprobs.detach())[tokens].mean()
    torch.testing.assert_close(metrics["ref_kl"], expected_ref_kl)


def test_teacher_and_ref_names_are_the_same_input():
    x = _sample(seed=4)
    seed_form = SeedInputs(
        x.trainer_logprobs, x.inference_logprobs, x.advantages, x.loss_mask, x.ref_logprobs
    )
    torch.testing.assert_close(loss_fn(seed_form, alpha_sdpo=0.2), loss_fn(x, alpha_sdpo=0.2))


def test_loss_weights_reproduce_per_component_normalisation():
    # Three samples packed into one row: PRIME-RL sums each sample's weighted sum and divides
    # by the component's global count; our trainer's rl component over the packed row,
    # divided by its own count, must be the same number.
    samples = [_sample(n, seed=10 + n, weights=True) for n in (17, 40, 9)]
    for s in samples:
        s.loss_weights[::5] = 0.0
    global_count = sum(int((s.loss_mask & (s.loss_weights != 0)).sum()) for s in samples)
    prime = sum(prime_rl_loss(s).loss for s in samples) / global_count
    packed = {
        name: torch.cat([getattr(s, name).detach() for s in samples])
        for name in (
            "trainer_logprobs",
            "inference_logprobs",
            "advantages",
            "loss_mask",
            "loss_weights",
        )
    }
    ours, count = rl_loss(
        packed["trainer_logprobs"],
        packed["inference_logprobs"],
        packed["advantages"],
        packed["loss_mask"],
        packed["loss_weights"],
    )
    assert int(count) == global_count
    torch.testing.assert_close(prime, ours / count, rtol=1e-12, atol=1e-12)


def test_metrics_are_zero_dim_tensors_on_the_input_device_and_dtype():
    x = _sample(seed=5, dtype=torch.float32)
    out = prime_rl_loss(x, alpha_sdpo=0.1)
    assert out.loss.dim() == 0 and out.loss.dtype == torch.float32
    assert set(out.metrics) == {
        "is_masked",
        "is_masked_high",
        "is_masked_low",
        "masked_mismatch_kl",
        "unmasked_mismatch_kl",
        "ref_kl",
        "ref_kl/is_masked",
        "ref_kl/masked_mismatch_kl",
        "ref_kl/unmasked_mismatch_kl",
    }
    for value in out.metrics.values():
        assert value.dim() == 0 and value.device == x.trainer_logprobs.device
        assert not value.requires_grad
    assert "ref_kl" not in prime_rl_loss(x).metrics


def test_a_sample_without_loss_tokens_gives_zero_and_a_graph():
    x = _sample(seed=6)
    x.loss_mask = torch.zeros_like(x.loss_mask)
    out = prime_rl_loss(x)
    assert float(out.loss.detach()) == 0.0
    out.loss.backward()
    assert torch.count_nonzero(x.trainer_logprobs.grad) == 0
    assert all(float(v) == 0.0 for v in out.metrics.values())


@pytest.mark.parametrize("name", sorted(composer_loss.DEFAULT_KNOBS))
@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_every_knob_rejects_negative_and_non_finite(name, bad):
    x = _sample(seed=7)
    with pytest.raises(ValueError, match=name):
        loss_fn(x, **{name: bad})
    with pytest.raises(ValueError, match=name):
        prime_rl_loss(x, **{name: bad})


def test_unknown_or_non_numeric_knob_is_named():
    x = _sample(seed=7)
    with pytest.raises(ValueError, match=r"unknown loss knob.*dppo_mask"):
        prime_rl_loss(x, dppo_mask=0.1)
    with pytest.raises(ValueError, match=r"kl_tau='0.1' must be a number"):
        prime_rl_loss(x, kl_tau="0.1")


def test_beta_dpo_is_refused_with_the_reason_and_zero_accepted():
    x = _sample(seed=8)
    with pytest.raises(ValueError, match=r"beta_dpo=0.05.*no pairs.*replay_dpo"):
        loss_fn(x, beta_dpo=0.05)
    torch.testing.assert_close(loss_fn(x, beta_dpo=0.0), loss_fn(x))


def test_alpha_without_reference_is_refused():
    x = _sample(seed=9)
    x.ref_logprobs = None
    with pytest.raises(ValueError, match="alpha_sdpo > 0 needs reference log-probs"):
        loss_fn(x, alpha_sdpo=0.1)
    loss_fn(x)  # alpha 0 needs none
    # PRIME-RL's packing filler (0.0 for a sample without reference log-probs) is refused.
    x.ref_logprobs = torch.zeros_like(x.inference_logprobs)
    with pytest.raises(ValueError, match="filler"):
        loss_fn(x, alpha_sdpo=0.1)
    x.ref_logprobs[~x.loss_mask] = -1.0  # outside the loss tokens: still the filler
    with pytest.raises(ValueError, match="filler"):
        prime_rl_loss(x, alpha_sdpo=0.1)
    x.ref_logprobs[x.loss_mask.nonzero()[0]] = -0.5  # one real value: a reference
    loss_fn(x, alpha_sdpo=0.1)


def test_shapes_and_types_are_checked():
    x = _sample(seed=11)
    two_d = Inputs(
        *(
            t.reshape(8, 8)
            for t in (
                x.trainer_logprobs.detach(),
                x.inference_logprobs,
                x.ref_logprobs,
                x.advantages,
                x.loss_mask,
            )
        )
    )
    with pytest.raises(ValueError, match=r"shape \(8, 8\).*1-D"):
        loss_fn(two_d)
    short = _sample(seed=11)
    short.advantages = short.advantages[:-1]
    with pytest.raises(ValueError, match=r"different lengths.*advantages"):
        prime_rl_loss(short)
    weights = _sample(seed=11, weights=True)
    weights.loss_weights = weights.loss_weights[:3]
    with pytest.raises(ValueError, match="loss_weights"):
        loss_fn(weights)
    missing = _sample(seed=11)
    missing.advantages = [0.0] * 64
    with pytest.raises(ValueError, match=r"inputs.advantages is list"):
        loss_fn(missing)
    ints = _sample(seed=11)
    ints.inference_logprobs = torch.zeros(64, dtype=torch.long)
    with pytest.raises(ValueError, match=r"inference_logprobs has dtype torch.int64"):
        loss_fn(ints)
    both = SeedInputs(
        x.trainer_logprobs, x.inference_logprobs, x.advantages, x.loss_mask, x.ref_logprobs
    )
    both.ref_logprobs = x.ref_logprobs + 1
    with pytest.raises(ValueError, match="both teacher_logprobs and ref_logprobs"):
        loss_fn(both, alpha_sdpo=0.1)


def _resolve_like_prime_rl(dotted_path: str):
    module_path, _, name = dotted_path.rpartition(".")
    module = importlib.import_module(module_path)
    return getattr(module, name)


def _resolve_colon_path(path: str):
    module_path, _, name = path.partition(":")
    return getattr(importlib.import_module(module_path), name)


def test_import_path_resolves_both_ways_and_runs_as_prime_rl_calls_it():
    fn = _resolve_like_prime_rl(IMPORT_PATH)
    assert fn is prime_rl_loss
    module, _, attr = IMPORT_PATH.rpartition(".")
    assert _resolve_colon_path(f"{module}:{attr}") is prime_rl_loss
    kwargs = {"dppo_mask_high": 0.1, "kl_tau": 0.002, "alpha_sdpo": 0.2}

    def rl_fn(inputs):  # how PRIME-RL's setup_rl_loss_fn wraps a custom loss
        return fn(inputs, **kwargs)

    x = _sample(seed=12)
    out = rl_fn(x)
    torch.testing.assert_close(out.loss, loss_fn(x, **kwargs))
    assert isinstance(out.metrics, dict)


def test_package_exports_the_same_objects_lazily():
    import composer_replication.recipes.prime_rl as package

    assert package.loss_fn is loss_fn and package.prime_rl_loss is prime_rl_loss
    assert package.IMPORT_PATH == IMPORT_PATH
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        package.nope  # noqa: B018
