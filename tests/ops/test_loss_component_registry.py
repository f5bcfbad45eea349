"""The loss components are declared once: a registered term trains through the packer, the
assembler and the step with no other change (the example in tests/examples/)."""

from __future__ import annotations

import pytest
import torch
from tests.examples import unlikelihood_term  # registers the "unlikelihood" component

from composer_replication.config.components import (
    BUILTIN_NAMES,
    LossComponent,
    component_names,
    loss_components,
    register_component,
    unregister_component,
)
from composer_replication.config.loss import LossConfig
from composer_replication.ops.assembler import micro_batch_losses
from composer_replication.samples.wire import TrainingSample, pack_samples
from composer_replication.training.step import train_step


@pytest.fixture(scope="module", autouse=True)
def _unlikelihood_registered():
    """The example term is registered for this module's tests only: other tests see the
    built-in components alone (their counts and metrics list every registered one)."""
    register_component(unlikelihood_term.UNLIKELIHOOD)
    yield
    unregister_component(unlikelihood_term.UNLIKELIHOOD.name)


@pytest.fixture(scope="module")
def policy():
    from composer_replication.model.loading import tiny_model

    return tiny_model(seed=0).double().train()


def _samples(with_term: bool = True):
    gen = torch.Generator().manual_seed(5)
    out = []
    for i in range(2):
        ids = torch.randint(10, 2000, (10 + i,), generator=gen).tolist()
        mask = [0] * 4 + [1] * (6 + i)
        inf = [0.0] * 4 + (-torch.rand(6 + i, generator=gen) - 4).tolist()
        sample = TrainingSample(ids, mask, inf, advantages=[0.5 * m for m in mask])
        if with_term:
            # on two prompt tokens and one sampled token: not only trainable positions count
            weights = [0.0] * len(ids)
            weights[2], weights[3], weights[6] = 1.0, 0.5, 2.0
            sample.weights["unlikelihood_weights"] = weights
        out.append(sample)
    return out


def _reference_sum(policy, samples) -> torch.Tensor:
    """The term by hand: log-softmax of a plain forward, sample by sample."""
    total = torch.zeros((), dtype=torch.float64)
    for s in samples:
        ids = torch.tensor([s.input_ids])
        logits = policy(input_ids=ids).logits.double()
        logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        w = torch.tensor(s.weights["unlikelihood_weights"][1:], dtype=torch.float64)
        total = total + (-torch.log1p(-logp.exp()) * w).sum()
    return total


def test_the_registry_lists_built_ins_first_then_registered_terms():
    assert component_names()[: len(BUILTIN_NAMES)] == ("rl", "ce", "ref_kl", "jsd", "dpo")
    assert "unlikelihood" in component_names()
    assert unlikelihood_term.UNLIKELIHOOD in loss_components()


def test_a_registered_term_is_packed_counted_and_computed(policy):
    samples = _samples()
    (mb,) = pack_samples(samples, max_tokens=10_000, split=None)
    assert mb.stream("unlikelihood_weights").shape == mb.input_ids.shape
    # next tokens with a weight: positions 2, 3, 6 of each row (2 rows)
    assert mb.counts["unlikelihood"] == 6
    losses = micro_batch_losses(policy, mb, LossConfig())
    expected = _reference_sum(policy, samples)
    assert losses.components["unlikelihood"].item() == pytest.approx(expected.item(), rel=1e-9)
    grad = torch.autograd.grad(losses.components["unlikelihood"], policy.lm_head.weight)[0]
    assert grad.abs().sum() > 0


def test_the_step_normalises_scales_and_reports_the_term(policy):
    samples = _samples()
    (mb,) = pack_samples(samples, max_tokens=10_000, split=None)
    expected = _reference_sum(policy, samples).item()
    cfg = LossConfig(coefficients={"unlikelihood": 0.0})
    policy.zero_grad()
    metrics = train_step(policy, [mb], cfg)
    assert metrics["tokens/unlikelihood"] == 6.0
    assert metrics["loss/unlikelihood"] == pytest.approx(expected / 6, rel=1e-9)
    # coefficient 0: the total is the built-in components' alone
    built_in = sum(metrics[f"loss/{c}"] for c in BUILTIN_NAMES)
    assert metrics["loss"] == pytest.approx(built_in, rel=1e-9)


def test_samples_without_the_stream_leave_the_term_out(policy):
    (mb,) = pack_samples(_samples(with_term=False), max_tokens=10_000, split=None)
    assert mb.stream("unlikelihood_weights") is None and mb.counts["unlikelihood"] == 0
    assert "unlikelihood" not in micro_batch_losses(policy, mb).components


def test_bad_declarations_and_streams_are_refused_in_one_line():
    with pytest.raises(ValueError, match="already registered"):
        register_component(LossComponent("rl", "x_weights", "weighted", "m:f"))
    with pytest.raises(ValueError, match="already belongs to 'ce'"):
        register_component(LossComponent("other", "ce_weights", "weighted", "m:f"))
    with pytest.raises(ValueError, match="pair component has stream None"):
        LossComponent("pairs_only", "p_weights", "pairs", "m:f")
    sample = _samples(with_term=False)[0]
    sample.weights["nobody_weights"] = [0.0] * sample.n_tokens
    with pytest.raises(ValueError, match="no registered loss component"):
        pack_samples([sample], max_tokens=100, split=None)
    with pytest.raises(ValueError, match="unknown components"):
        LossConfig(coefficients={"nobody": 1.0})


def test_the_term_and_its_algorithm_train_through_the_loop(tmp_path, tiny_dir):
    """The example module's algorithm, named by import path, stamps the new stream; the native
    loop trains it with no other change and reports it (no rl credit: tokens/rl is 0)."""
    import sys
    from pathlib import Path

    from composer_replication.config import RunConfig
    from composer_replication.training.loop import Trainer

    sys.path.insert(0, str(Path(__file__).parents[1] / "training"))
    from scripted_env import ScriptedEnv, scripted_run_toml

    config = RunConfig.from_toml(
        scripted_run_toml(
            tmp_path / "run",
            tiny_dir,
            steps=2,
            advantage='type = "tests.examples.unlikelihood_term:UnlikelihoodOnFailures"\n'
            "below = 1.0",
        )
    )
    trainer = Trainer(config, environments={"scripted": ScriptedEnv(rising=False)})
    result = trainer.run()
    rows = [r for r in result.metrics if "tokens/unlikelihood" in r]
    assert len(rows) == 2
    for row in rows:  # every sampled token of every (failed, reward 0.5) rollout
        assert row["tokens/unlikelihood"] > 0 and row["loss/unlikelihood"] > 0
        assert row["tokens/rl"] == 0.0
