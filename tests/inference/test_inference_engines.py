"""The two inference engines behind one protocol (``roles.InferenceEngine``): each is an
instance of it and takes, method by method, the protocol's parameters; the in-process
engine's versions and its sample-ahead copy; and the frozen models' endpoints, read by the
environments without rewriting the run's config."""

from __future__ import annotations

import inspect

import pytest
import torch

from composer_replication import roles
from composer_replication.config.references import FrozenEndpoint
from composer_replication.config.run import RunConfig
from composer_replication.inference.decoding.generate import DecodeOptions
from composer_replication.inference.engine import PolicyEngine
from composer_replication.inference.frozen import served
from composer_replication.inference.in_process import InProcessEngine
from composer_replication.model.loading import tiny_model


@pytest.mark.parametrize("engine", [InProcessEngine, PolicyEngine])
def test_every_engine_takes_the_protocols_parameters(engine):
    members = ("sampler", "version", *roles.protocol_methods(roles.InferenceEngine))
    assert set(roles.protocol_methods(roles.InferenceEngine)) == {
        "after_step",
        "sampling_ahead",
        "start",
        "stop",
    }
    for name in members:
        mine, theirs = getattr(engine, name), getattr(roles.InferenceEngine, name)
        if isinstance(theirs, property):
            assert isinstance(mine, property), name
            continue
        shape = [(p.name, p.kind, p.default) for p in inspect.signature(theirs).parameters.values()]
        got = [(p.name, p.kind, p.default) for p in inspect.signature(mine).parameters.values()]
        assert got == shape, name
    assert isinstance(InProcessEngine(tiny_model(seed=0)), roles.InferenceEngine)


def test_the_in_process_engine_samples_ahead_from_a_copy_it_refreshes():
    policy = tiny_model(seed=0)
    decode = DecodeOptions(loop="general", sync_every=4)
    engine = InProcessEngine(policy, decode=decode, sample_ahead=True)
    assert engine.snapshot is None and engine.version == 0
    engine.start(policy, 3)  # a run resumed at step 3
    assert engine.snapshot is not None and engine.version == 3
    with engine.sampling_ahead() as ahead:
        assert ahead.model is engine.snapshot.model and ahead.model is not policy
        assert ahead.decode == decode and ahead.samples_from_live_policy
    assert engine.sampler.model is policy and engine.sampler.decode == decode
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    assert engine.after_step(policy, 4) == {}
    assert engine.version == 4
    live = dict(policy.named_parameters())
    for name, tensor in engine.snapshot.model.named_parameters():
        assert torch.equal(tensor, live[name])
    engine.stop()
    assert engine.snapshot is None


def test_the_in_process_engine_without_sampling_ahead_samples_the_live_policy():
    policy = tiny_model(seed=0)
    engine = InProcessEngine(policy)
    engine.start(policy, 0)
    assert engine.snapshot is None
    with engine.sampling_ahead() as sampler:
        assert sampler is engine.sampler
    engine.after_step(policy, 1)
    assert engine.version == 1  # the live policy's own version


def test_served_frozen_models_are_read_at_their_endpoints():
    config = RunConfig.from_toml("""
[inference]
engine = "vllm"
[[envs]]
name = "python_functions"
[envs.algorithm.advantage]
type = "opd"
model = { name = "t", local_path = "embedded" }
[[envs]]
name = "feature_deletion"
[envs.algorithm.sampling]
source = { name = "t", local_path = "/models/other" }
[envs.algorithm.advantage]
type = "sft"
""")
    endpoint = FrozenEndpoint(name="policy", base_url="http://127.0.0.1:9/v1")
    opd, sft = (served(env, {"embedded": endpoint}) for env in config.envs)
    assert opd.algorithm.advantage.model == endpoint
    assert opd.algorithm.sampling == config.envs[0].algorithm.sampling
    assert sft is config.envs[1]  # its path is not served: untouched
    assert config.envs[0].algorithm.advantage.model.local_path == "embedded"  # not rewritten
