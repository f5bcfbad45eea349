"""Each environment's Sampler (``rollout.env_sampler.EnvSampler``): its source for every
kind of ``sampling.source``, whether that is the live policy, the arguments it samples with
(a frozen endpoint is asked for no log-probs) and its rollouts' provenance (a frozen
source's are marked and carry no policy version)."""

from __future__ import annotations

import pytest

from composer_replication.config.algorithm import SamplingConfig
from composer_replication.config.references import FrozenEndpoint, LocalFrozenModel
from composer_replication.envs.python_functions import PythonFunctionsEnv, reference_demonstration
from composer_replication.inference.decoding.generate import InProcessSampler, SamplingSettings
from composer_replication.rollout.demonstrations import ReferenceSolutions
from composer_replication.rollout.endpoint_sampler import EndpointSampler
from composer_replication.rollout.env_sampler import EnvSampler
from composer_replication.testing import CompletionsServer

REPLY = "```python\ndef f():\n    return 1\n```"


@pytest.fixture(scope="module")
def env():
    return PythonFunctionsEnv()


def test_the_live_policy_samples_with_log_probs_and_no_mark(env, tiny):
    model, tokenizer = tiny
    sampler = EnvSampler.from_config(SamplingConfig(group_size=2, max_new_tokens=3))
    live = InProcessSampler(model)
    assert sampler.source is None and sampler.samples_from_live_policy
    assert sampler.pool(live) is live
    assert sampler.sampling_args() == SamplingSettings(max_new_tokens=3, temperature=1.0)
    assert sampler.sampling_args().logprobs
    ids = env.task_ids()[:2]
    groups = sampler.rollouts(env, live, tokenizer, ids, graded=False)
    assert [len(g) for g in groups] == [2, 2]
    for r in (r for g in groups for r in g):
        assert not r.from_frozen_source and r.policy_version is None
        assert len(r.completion_ids) <= 3 and any(lp != 0.0 for lp in r.inference_logprobs)


def test_a_frozen_endpoint_is_asked_for_no_log_probs_and_its_rollouts_are_marked(env, tokenizer):
    with CompletionsServer(tokenizer, REPLY) as server:
        config = SamplingConfig(
            source=FrozenEndpoint(name="teacher", base_url=server.base_url),
            group_size=2,
            max_new_tokens=64,
            temperature=0.5,
        )
        sampler = EnvSampler.from_config(config)
        assert isinstance(sampler.source, EndpointSampler)
        assert not sampler.samples_from_live_policy
        args = sampler.sampling_args()
        assert (args.logprobs, args.max_new_tokens, args.temperature) == (False, 64, 0.5)
        live = InProcessSampler(object())  # never asked: the endpoint samples
        ids = env.task_ids()[:2]
        groups = sampler.rollouts(env, live, tokenizer, ids, graded=False)
        bodies = [r.body for r in server.requests]
    assert len(bodies) == 4 and all("logprobs" not in b for b in bodies)
    assert {b["model"] for b in bodies} == {"teacher"} and {b["temperature"] for b in bodies} == {
        0.5
    }
    rollouts = [r for g in groups for r in g]
    assert [r.task_id for r in rollouts] == [ids[0], ids[0], ids[1], ids[1]]
    for r in rollouts:
        assert r.from_frozen_source and r.policy_version is None
        assert r.metadata["completion_text"] == REPLY
        assert r.inference_logprobs == [0.0] * len(r.completion_ids)  # none were asked for


def test_the_reference_solutions_are_a_frozen_source(env, tokenizer):
    sampler = EnvSampler.from_config(SamplingConfig(source="reference", group_size=1))
    assert isinstance(sampler.source, ReferenceSolutions) and sampler.group_size == 1
    assert not sampler.samples_from_live_policy
    ids = env.task_ids()[:2]
    groups = sampler.rollouts(env, InProcessSampler(object()), tokenizer, ids)
    for tid, (r,) in zip(ids, groups):
        assert r.is_demonstration and r.from_frozen_source and r.policy_version is None
        text = tokenizer.decode(r.completion_ids[:-1])
        assert text == reference_demonstration(env.tasks[tid])


def test_a_frozen_local_model_samples_in_process_without_being_live(tiny_dir):
    sampler = EnvSampler.from_config(
        SamplingConfig(source=LocalFrozenModel(name="teacher", local_path=tiny_dir))
    )
    assert isinstance(sampler.source, InProcessSampler)
    assert not sampler.source.samples_from_live_policy and not sampler.samples_from_live_policy
    assert not any(p.requires_grad for p in sampler.source.model.parameters())
    assert sampler.sampling_args().logprobs is False


def test_sampling_only_needs_an_environment_that_grades_apart(tiny):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "training"))
    from scripted_env import ScriptedEnv

    model, tokenizer = tiny
    sampler = EnvSampler.from_config(SamplingConfig())
    with pytest.raises(ValueError, match="'scripted' grades inside its rollouts"):
        sampler.rollouts(ScriptedEnv(), InProcessSampler(model), tokenizer, ["s"], graded=False)
