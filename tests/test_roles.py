"""The roles as protocols (``composer_replication.roles``): every implementation is an
instance of its role's runtime-checkable protocol and takes, method by method, exactly the
protocol's parameters; what is not a role is refused; and the native loop runs with another
implementation of a role than its default: a frozen endpoint's sampler, on the suite's local
completions server, samples an sft environment's rollouts."""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import pytest

from composer_replication import roles
from composer_replication.config import RunConfig
from composer_replication.envs.base import DemonstratingEnvironment, Environment, SplitEnvironment

sys.path.insert(0, str(Path(__file__).parent / "training"))
from scripted_env import ScriptedEnv


def _classes():
    """(protocol, implementation) for every implementation the package has."""
    from composer_replication.distributed.fsdp import NoSharding
    from composer_replication.envs.python_functions import PythonFunctionsEnv
    from composer_replication.inference.decoding.generate import InProcessSampler
    from composer_replication.inference.in_process import InProcessEngine
    from composer_replication.inference.sampler import EngineSampler
    from composer_replication.recipes.monarch.engine import (
        RemoteGrader,
        RemoteLearner,
        _WholeCopy,
    )
    from composer_replication.rollout.endpoint_sampler import EndpointSampler
    from composer_replication.training.learner import Learner
    from composer_replication.training.lifecycle import RunLifecycle

    return [
        (roles.Sampler, InProcessSampler),
        (roles.Sampler, EngineSampler),
        (roles.Sampler, EndpointSampler),
        (roles.Grader, PythonFunctionsEnv),
        (roles.Grader, RemoteGrader),
        (roles.Learner, Learner),
        (roles.Learner, RemoteLearner),
        (roles.PolicyWeights, NoSharding),
        (roles.PolicyWeights, _WholeCopy),
        (roles.Evaluator, RunLifecycle),
        # (PolicyEngine's sampler starts its server when read, which isinstance does:
        # tests/inference/test_inference_engines.py checks it against the protocol)
        (roles.InferenceEngine, InProcessEngine),
        (SplitEnvironment, PythonFunctionsEnv),
        (DemonstratingEnvironment, PythonFunctionsEnv),
    ]


PAIRS = [(p.__name__, c.__name__) for p, c in _classes()]


def _parameters(function) -> list[inspect.Parameter]:
    return list(inspect.signature(function).parameters.values())


def _takes(implementation, protocol) -> bool:
    """``implementation`` takes the protocol method's parameters (same names, kinds and
    defaults, in order); any parameter it adds is optional."""
    mine, theirs = _parameters(implementation), _parameters(protocol)
    shape = [(p.name, p.kind, p.default) for p in theirs]
    return [(p.name, p.kind, p.default) for p in mine[: len(theirs)]] == shape and all(
        p.default is not inspect.Parameter.empty
        or p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        for p in mine[len(theirs) :]
    )


@pytest.mark.parametrize("index", range(len(PAIRS)), ids=[f"{c}-{p}" for p, c in PAIRS])
def test_every_method_of_an_implementation_takes_its_roles_parameters(index):
    protocol, implementation = _classes()[index]
    methods = roles.protocol_methods(protocol)
    assert methods  # the protocol names what it needs
    for name in methods:
        assert _takes(getattr(implementation, name), getattr(protocol, name)), (
            f"{implementation.__name__}.{name}{inspect.signature(getattr(implementation, name))}"
        )


def test_the_signature_check_sees_a_different_or_a_required_parameter():
    from composer_replication.rollout.scripted import ScriptedSampler

    # a SampleFn (prompts, settings) is not a Sampler's sample_batch
    assert not _takes(ScriptedSampler.__call__, roles.Sampler.sample_batch)

    def update(self, batches, step, extra):  # one more required parameter
        return {}

    def lr(self, *, now=True):  # one more optional one
        return 0.0

    assert not _takes(update, roles.Learner.update)
    assert _takes(lr, roles.Learner.lr)


@pytest.fixture(scope="module")
def instances(tmp_path_factory, tiny):
    """One object of every implementation (none of them calls out when built)."""
    from composer_replication.distributed.fsdp import NoSharding
    from composer_replication.envs.python_functions import PythonFunctionsEnv
    from composer_replication.inference.decoding.generate import InProcessSampler
    from composer_replication.inference.in_process import InProcessEngine
    from composer_replication.inference.sampler import EngineSampler
    from composer_replication.recipes.monarch.engine import (
        RemoteGrader,
        RemoteLearner,
        _WholeCopy,
    )
    from composer_replication.rollout.endpoint_sampler import EndpointSampler
    from composer_replication.training.learner import Learner
    from composer_replication.training.lifecycle import RunLifecycle

    model, _ = tiny
    config = RunConfig(output_dir=str(tmp_path_factory.mktemp("roles") / "run"))
    env = PythonFunctionsEnv()
    return {
        InProcessSampler: InProcessSampler(model),
        EngineSampler: EngineSampler("http://127.0.0.1:9"),
        EndpointSampler: EndpointSampler("http://127.0.0.1:9/v1", "frozen"),
        PythonFunctionsEnv: env,
        RemoteGrader: RemoteGrader(mesh=None, env_index=0),
        Learner: Learner(
            model,
            model=config.model,
            optim=config.optim,
            loss=config.loss,
            steps=config.steps,
        ),
        RemoteLearner: RemoteLearner(mesh=None, policy=model),
        NoSharding: NoSharding(),
        _WholeCopy: _WholeCopy(),
        RunLifecycle: RunLifecycle(config, backend="native"),
        InProcessEngine: InProcessEngine(model),
    }


@pytest.mark.parametrize("index", range(len(PAIRS)), ids=[f"{c}-{p}" for p, c in PAIRS])
def test_every_implementation_is_an_instance_of_its_role(index, instances):
    protocol, implementation = _classes()[index]
    assert isinstance(instances[implementation], protocol)


def test_samplers_say_whether_they_sample_the_live_policy(instances):
    from composer_replication.inference.decoding.generate import InProcessSampler
    from composer_replication.inference.sampler import EngineSampler
    from composer_replication.rollout.endpoint_sampler import EndpointSampler

    assert instances[InProcessSampler].samples_from_live_policy is True
    assert InProcessSampler(object(), live=False).samples_from_live_policy is False
    assert instances[EngineSampler].samples_from_live_policy is True
    assert instances[EndpointSampler].samples_from_live_policy is False


def test_what_is_not_a_role_is_refused(tiny):
    from composer_replication.rollout.scripted import ScriptedSampler

    model, tokenizer = tiny
    assert not isinstance(model, roles.Sampler)  # a model is sampled through a Sampler
    assert not isinstance(ScriptedSampler(tokenizer, [["hi"]]), roles.Sampler)
    assert not isinstance(model, roles.Learner)
    env = ScriptedEnv()
    assert isinstance(env, Environment)
    assert not isinstance(env, roles.Grader)  # grades inside its rollouts
    assert not isinstance(env, SplitEnvironment)
    assert not isinstance(env, DemonstratingEnvironment)


def test_the_loop_samples_through_another_sampler(tmp_path, tiny_dir, tokenizer):
    """An sft environment whose source is a frozen endpoint: the loop hands the
    environment an ``EndpointSampler`` (not the policy), the rollouts are the server's
    reply and the ce component trains on exactly those tokens."""
    from composer_replication.testing import CompletionsServer
    from composer_replication.training.loop import Trainer

    reply = "def f():\n    return 1"
    with CompletionsServer(tokenizer, reply) as server:
        config = RunConfig.from_toml(f'''
seed = 0
steps = 1
output_dir = "{tmp_path / "run"}"
[model]
source = "{tiny_dir}"
[optim]
lr = 1e-3
[eval]
at_start = false
max_tasks = 1
samples_per_task = 1
temperature = 0
[guard]
min_steps = 100
[[envs]]
name = "scripted"
tasks_per_step = 2
[envs.algorithm.sampling]
group_size = 2
source = {{ name = "frozen", base_url = "{server.base_url}" }}
[envs.algorithm.advantage]
type = "sft"
''')
        env = ScriptedEnv()
        trainer = Trainer(config, environments={"scripted": env})
        result = trainer.run()
        bodies = [r.body for r in server.requests]
    assert result.steps == 1
    # the 4 training rollouts came from the endpoint (evaluation samples the policy)
    assert [c for c in env.calls if c[0] == "train"] and len(bodies) == 4
    assert {b["model"] for b in bodies} == {"frozen"}
    # what the server sent back (its reply cut to the environment's max_new_tokens), as
    # text, in the policy's tokens
    cut = tokenizer(reply, add_special_tokens=False)["input_ids"][: env.max_new_tokens]
    expected = tokenizer(tokenizer.decode(cut), add_special_tokens=False)["input_ids"]
    row = next(
        json.loads(line)
        for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
        if json.loads(line).get("step") == 1 and "loss" in json.loads(line)
    )
    assert row["tokens/ce"] == 4 * len(expected)
    assert row["tokens/rl"] == 0
