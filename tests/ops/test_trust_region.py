"""ref_kl trust-region metrics (PRIME-RL's ref_kl loss metrics): the pure functions against
values computed by hand, and the trainer step emitting them only when ref_kl is active."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from composer_replication.ops.trust_region import (
    REF_KL_SAMPLE_METRICS,
    mismatch_kl,
    ref_kl_sample_metrics,
    ref_kl_step_metrics,
)
from composer_replication.samples.wire import TrainingSample, pack_samples
from composer_replication.training.step import train_step

STEP_KEYS = {f"{name}/mean" for name in REF_KL_SAMPLE_METRICS}

# One sample of five tokens, as probabilities (trainer p, sampler p_inf, reference p_ref):
#   t0: p = p_inf = 0.5, p_ref = 0.25       -> kept, mismatch 0,    ref - lp = -log 2
#   t1: p = 0.2, p_inf = 0.6, p_ref = 0.4   -> dp = -0.4: masked,   ref - lp = log 2
#   t2: p = 0.9, p_inf = 0.6, p_ref = 0.3   -> dp = +0.3: kept,     ref - lp = -log 3
#   t3: outside loss_mask (an observation token), values that would be masked
#   t4: in loss_mask but ref_kl weight 0, values that would be masked
P = [0.5, 0.2, 0.9, 0.01, 0.1]
P_INF = [0.5, 0.6, 0.6, 0.9, 0.8]
P_REF = [0.25, 0.4, 0.3, 0.5, 0.5]
LOSS_MASK = [1, 1, 1, 0, 1]
WEIGHTS = [1.0, 1.0, 1.0, 1.0, 0.0]


def _log(values):
    return torch.tensor([math.log(v) for v in values], dtype=torch.float64)


def _mkl(p, p_inf):
    r = p / p_inf
    return r - math.log(r) - 1


def test_mismatch_kl_is_the_k3_estimate():
    got = mismatch_kl(_log([0.2, 0.9, 0.5]), _log([0.6, 0.6, 0.5]))
    expected = [1 / 3 + math.log(3) - 1, 0.5 - math.log(1.5), 0.0]
    assert got.tolist() == pytest.approx(expected, abs=1e-12)
    assert bool((got >= 0).all())


def test_sample_metrics_by_hand():
    got = ref_kl_sample_metrics(
        _log(P), _log(P_INF), _log(P_REF), torch.tensor(LOSS_MASK), torch.tensor(WEIGHTS)
    )
    assert set(got) == set(REF_KL_SAMPLE_METRICS)
    assert all(v.shape == (1,) for v in got.values())
    assert got["ref_kl"].item() == pytest.approx((-math.log(2) + math.log(2) - math.log(3)) / 3)
    assert got["ref_kl/is_masked"].item() == pytest.approx(1 / 3)
    assert got["ref_kl/masked_mismatch_kl"].item() == pytest.approx(_mkl(0.2, 0.6))
    assert got["ref_kl/unmasked_mismatch_kl"].item() == pytest.approx(
        (_mkl(0.5, 0.5) + _mkl(0.9, 0.6)) / 2
    )


def test_without_weights_every_trainable_token_counts():
    got = ref_kl_sample_metrics(_log(P), _log(P_INF), _log(P_REF), torch.tensor(LOSS_MASK))
    # t4 joins: p = 0.1, p_inf = 0.8 -> dp = -0.7, masked; ref - lp = log 5
    assert got["ref_kl/is_masked"].item() == pytest.approx(2 / 4)
    assert got["ref_kl"].item() == pytest.approx((-math.log(3) + math.log(5)) / 4)
    assert got["ref_kl/masked_mismatch_kl"].item() == pytest.approx(
        (_mkl(0.2, 0.6) + _mkl(0.1, 0.8)) / 2
    )


def test_mask_low_sets_the_trust_region():
    args = (_log(P), _log(P_INF), _log(P_REF), torch.tensor(LOSS_MASK), torch.tensor(WEIGHTS))
    wide = ref_kl_sample_metrics(*args, mask_low=0.5)  # dp = -0.4 is now inside
    assert wide["ref_kl/is_masked"].item() == 0.0
    assert wide["ref_kl/masked_mismatch_kl"].item() == 0.0  # no masked token: 0, not NaN
    assert wide["ref_kl/unmasked_mismatch_kl"].item() == pytest.approx(
        (_mkl(0.5, 0.5) + _mkl(0.2, 0.6) + _mkl(0.9, 0.6)) / 3
    )
    # a just-inside and a just-outside token of the default bound 0.2
    edge = ref_kl_sample_metrics(
        _log([0.41, 0.39]), _log([0.6, 0.6]), _log([0.5, 0.5]), torch.tensor([1, 1])
    )
    assert edge["ref_kl/is_masked"].item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match=r"mask_low=-0\.1"):
        ref_kl_sample_metrics(*args, mask_low=-0.1)


def test_rows_are_samples_and_empty_rows_are_left_out():
    lp = torch.stack([_log(P), _log([0.5] * 5), _log([0.3, 0.3, 0.3, 0.3, 0.3])])
    inf = torch.stack([_log(P_INF), _log([0.5] * 5), _log([0.6, 0.6, 0.6, 0.6, 0.6])])
    ref = torch.stack([_log(P_REF), _log([0.5] * 5), _log([0.3] * 5)])
    mask = torch.tensor([LOSS_MASK, [0, 0, 0, 0, 0], [0, 1, 1, 0, 0]])
    weights = torch.tensor([WEIGHTS, [1.0] * 5, [0.0, 1.0, 0.5, 0.0, 0.0]])
    got = ref_kl_sample_metrics(lp, inf, ref, mask, weights)
    assert got["ref_kl/is_masked"].tolist() == pytest.approx([1 / 3, 1.0])  # row 1 left out
    assert got["ref_kl"].tolist() == pytest.approx([-math.log(3) / 3, 0.0])
    with pytest.raises(ValueError, match="share one shape"):
        ref_kl_sample_metrics(lp, inf, ref, mask[:, :4])


def test_step_metrics_average_samples_not_tokens():
    # sample A: one token, masked; samples B and C: none masked (B has three tokens)
    a = {k: torch.tensor([v]) for k, v in zip(REF_KL_SAMPLE_METRICS, (-0.3, 1.0, 0.2, 0.0))}
    bc = {
        k: torch.tensor(v)
        for k, v in zip(REF_KL_SAMPLE_METRICS, ([0.1, -0.1], [0.0, 0.0], [0.0, 0.0], [0.01, 0.04]))
    }
    got = ref_kl_step_metrics([a, bc])
    assert set(got) == STEP_KEYS
    assert got["ref_kl/is_masked/mean"] == pytest.approx(1 / 3)
    assert got["ref_kl/mean"] == pytest.approx(-0.1)
    assert got["ref_kl/masked_mismatch_kl/mean"] == pytest.approx(0.2 / 3)
    assert got["ref_kl/unmasked_mismatch_kl/mean"] == pytest.approx(0.05 / 3)
    empty = {k: torch.zeros(0) for k in REF_KL_SAMPLE_METRICS}
    assert ref_kl_step_metrics([]) == {}
    assert ref_kl_step_metrics([empty]) == {}


# ------------------------------------------------------------------ through the step


@pytest.fixture(scope="module")
def base_model():
    from composer_replication.model.loading import tiny_model

    return tiny_model(seed=0).double()


def _ids(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, 2000, (n,), generator=gen).tolist()


def _naive_logprobs(model, ids) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    return [0.0, *lp.tolist()]


def _opd_sample(model, seed: int, n_prompt: int, n_completion: int, shifts) -> TrainingSample:
    """A ref_kl sample whose sampler log-probs are set from the policy's own: token k gets
    p_inf = p + shifts[k] (shift > 0.2: outside the trust region)."""
    ids = _ids(seed, n_prompt + n_completion)
    lp = _naive_logprobs(model, ids)
    mask = [0] * n_prompt + [1] * n_completion
    inf = [0.0] * n_prompt
    for k, pos in enumerate(range(n_prompt, n_prompt + n_completion)):
        inf.append(math.log(min(math.exp(lp[pos]) + shifts[k], 0.999)))
    gen = torch.Generator().manual_seed(seed + 7)
    ref = [0.0] * n_prompt + (-torch.rand(n_completion, generator=gen) * 3 - 5).tolist()
    return TrainingSample(
        ids,
        mask,
        inf,
        rl_weights=[0.0] * len(ids),
        ref_kl_weights=[float(m) for m in mask],
        ref_logprobs=ref,
    )


def _expected(model, sample: TrainingSample) -> dict[str, float]:
    """The four per-sample values with plain Python arithmetic."""
    lp = _naive_logprobs(model, sample.input_ids)
    tok = [t for t in range(1, len(lp)) if sample.loss_mask[t] and sample.ref_kl_weights[t]]
    # the wire carries streams as float32
    inf = [float(torch.tensor(sample.inference_logprobs[t], dtype=torch.float32)) for t in tok]
    ref = [float(torch.tensor(sample.ref_logprobs[t], dtype=torch.float32)) for t in tok]
    p = [lp[t] for t in tok]
    masked = [math.exp(a) - math.exp(b) < -0.2 for a, b in zip(p, inf)]
    mkl = [math.exp(a - b) - (a - b) - 1 for a, b in zip(p, inf)]
    n_masked = sum(masked)
    n_kept = len(tok) - n_masked
    return {
        "ref_kl": sum(r - a for r, a in zip(ref, p)) / len(tok),
        "ref_kl/is_masked": n_masked / len(tok),
        "ref_kl/masked_mismatch_kl": (
            sum(k for k, m in zip(mkl, masked) if m) / n_masked if n_masked else 0.0
        ),
        "ref_kl/unmasked_mismatch_kl": (
            sum(k for k, m in zip(mkl, masked) if not m) / n_kept if n_kept else 0.0
        ),
    }


def _rl_sample(seed: int) -> TrainingSample:
    ids = _ids(seed, 10)
    mask = [0] * 4 + [1] * 6
    return TrainingSample(ids, mask, [0.0] * 4 + [-7.0] * 6, advantages=[0.5 * m for m in mask])


def test_step_emits_ref_kl_metrics_equal_to_hand_computation(base_model):
    model = copy.deepcopy(base_model)
    a = _opd_sample(model, 1, 4, 6, [0.0, 0.3, 0.05, 0.5, 0.0, 0.25])  # 3 of 6 masked
    b = _opd_sample(model, 2, 3, 4, [0.01, 0.0, 0.02, 0.0])  # none masked
    batches = pack_samples([a, b, _rl_sample(3)], max_tokens=12, split=None)
    assert len(batches) > 1  # the step pools samples over micro-batches
    metrics = train_step(model, batches)
    ea, eb = _expected(base_model, a), _expected(base_model, b)
    assert ea["ref_kl/is_masked"] == pytest.approx(0.5)
    assert eb["ref_kl/is_masked"] == 0.0 and eb["ref_kl/masked_mismatch_kl"] == 0.0
    for name in REF_KL_SAMPLE_METRICS:
        want = (ea[name] + eb[name]) / 2
        assert metrics[f"{name}/mean"] == pytest.approx(want, rel=1e-6, abs=1e-9), name
    assert metrics["ref_kl/masked_mismatch_kl/mean"] > 0
    assert metrics["tokens/ref_kl"] == 10.0 and metrics["tokens/rl"] == 6.0


def test_step_without_ref_kl_emits_none(base_model):
    model = copy.deepcopy(base_model)
    metrics = train_step(model, pack_samples([_rl_sample(4)], max_tokens=100, split=None))
    assert not STEP_KEYS & set(metrics)
    assert metrics["tokens/ref_kl"] == 0.0


def test_step_metrics_follow_the_loss_trust_region_setting(base_model):
    from composer_replication.training.step import LossConfig

    model = copy.deepcopy(base_model)
    a = _opd_sample(model, 1, 4, 6, [0.0, 0.3, 0.05, 0.5, 0.0, 0.25])
    batches = pack_samples([a], max_tokens=100, split=None)
    wide = train_step(model, batches, LossConfig(mask_low=0.9))
    assert wide["ref_kl/is_masked/mean"] == 0.0
    assert wide["ref_kl/masked_mismatch_kl/mean"] == 0.0
