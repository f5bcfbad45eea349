"""A user's algorithm, named by import path in the run config, validates with its own
options and declarations and trains through the real native loop: the loop drives its
stages (process_group per group, score per batch) and its samples are what the learner
steps on. The algorithm is one module, ``example_user_algorithm``."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
from pydantic import ValidationError

from composer_replication.algo import build_algorithm
from composer_replication.common.errors import UsageError
from composer_replication.config import AlgorithmConfig, RunConfig
from composer_replication.training.loop import Trainer

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "training"))
from example_user_algorithm import LeaveOneOut, LeaveOneOutAdvantage
from scripted_env import ScriptedEnv

TYPE = "example_user_algorithm:LeaveOneOut"
STEPS, TASKS_PER_STEP, GROUP_SIZE = 2, 2, 3


def _error(**config) -> str:
    with pytest.raises(ValidationError) as info:
        AlgorithmConfig(**config)
    (error,) = info.value.errors()
    assert "\n" not in error["msg"]
    return error["msg"].removeprefix("Value error, ")


def test_the_config_class_holds_the_options_and_the_declarations():
    config = AlgorithmConfig(advantage={"type": TYPE, "scale": 2})
    assert type(config.advantage) is LeaveOneOutAdvantage and config.advantage.scale == 2.0
    assert (LeaveOneOut.name, LeaveOneOut.components) == (TYPE, ("rl",))
    # the TOML round trip keeps the user's options
    assert 'type = "example_user_algorithm:LeaveOneOut"\nscale = 2.0' in config.to_toml()
    assert AlgorithmConfig.from_toml(config.to_toml()) == config
    assert type(build_algorithm(config)) is LeaveOneOut
    # its declarations drive the same validation as a built-in algorithm's
    with pytest.warns(UserWarning, match=f"'{TYPE}' is group-relative"):
        AlgorithmConfig(sampling={"group_size": 1}, advantage={"type": TYPE})
    frozen = {"name": "teacher", "base_url": "http://127.0.0.1:9/v1"}
    assert "needs the policy's own sampling log-probs" in _error(
        sampling={"source": frozen}, advantage={"type": TYPE}
    )


@pytest.mark.parametrize(
    ("advantage", "message"),
    [
        ({"scale": -1}, f"type '{TYPE}': scale: Input should be greater than 0 (got -1)"),
        ({"bogus": 1}, f"type '{TYPE}': bogus: Extra inputs are not permitted (got 1)"),
        (
            {"type": "grpoo"},
            "type 'grpoo' is neither a built-in algorithm (grpo, max_rl, reward, custom, opd, "
            "opsd, sdpo, sft, echo, replay_dpo, composer) nor 'package.module:Class' of an "
            "Algorithm subclass (did you mean 'grpo'?); set one of those",
        ),
        (
            {"type": "no_such_module:Algo"},
            "type 'no_such_module:Algo': module 'no_such_module' does not import "
            "(ModuleNotFoundError: No module named 'no_such_module'); set type to a built-in "
            "algorithm or to 'package.module:Class' of an Algorithm subclass",
        ),
        (
            {"type": "example_user_algorithm:Missing"},
            "type 'example_user_algorithm:Missing': module 'example_user_algorithm' has no "
            "'Missing'",
        ),
        (
            {"type": "example_user_algorithm:LeaveOneOutAdvantage"},
            "type 'example_user_algorithm:LeaveOneOutAdvantage' is not an Algorithm subclass",
        ),
        (
            {"type": "composer_replication.algo:GRPOAlgorithm"},
            "type 'composer_replication.algo:GRPOAlgorithm': GRPOAlgorithm.config_class is "
            "GRPOAdvantage; give GRPOAlgorithm a config_class of its own, a subclass of "
            "composer_replication.config.advantage.UserAdvantage",
        ),
    ],
)
def test_a_bad_user_type_is_one_line_naming_it(advantage, message):
    assert message in _error(advantage={"type": TYPE, **advantage})


def test_declarations_are_checked_where_they_are_made():
    from composer_replication.algo import Algorithm
    from composer_replication.config.advantage import UserAdvantage

    with pytest.raises(TypeError, match=r"trains in the native loop only"):

        class OnTrl(UserAdvantage):
            trains = ("rl",)
            backends = frozenset({"native", "trl"})

    with pytest.raises(TypeError, match=r"components = \('ce',\) but its config"):

        class Contradicting(Algorithm):
            config_class = LeaveOneOutAdvantage
            components = ("ce",)


def test_a_user_algorithm_trains_known_components(monkeypatch):
    import types

    from composer_replication.algo import Algorithm
    from composer_replication.config.advantage import UserAdvantage

    class TyposAdvantage(UserAdvantage):
        trains = ("rl", "cee")

    class Typos(Algorithm):
        config_class = TyposAdvantage

    module = types.ModuleType("typo_algorithms")
    module.Typos = Typos
    monkeypatch.setitem(sys.modules, "typo_algorithms", module)
    # the known names are the registry's: the built-in ones, and any a test registered
    assert _error(advantage={"type": "typo_algorithms:Typos"}).startswith(
        "type 'typo_algorithms:Typos': TyposAdvantage.trains names unknown loss components "
        "['cee']; use some of ('rl', 'ce', 'ref_kl', 'jsd', 'dpo'"
    )


def _config(tmp_path, tiny_dir) -> RunConfig:
    return RunConfig.from_toml(f'''
steps = {STEPS}
output_dir = "{tmp_path / "run"}"
[model]
source = "{tiny_dir}"
[model.lora]
r = 4
alpha = 8
[eval]
at_start = false
every = {STEPS}
max_tasks = 1
samples_per_task = 1
temperature = 0
[[envs]]
name = "scripted"
tasks_per_step = {TASKS_PER_STEP}
[envs.algorithm.sampling]
group_size = {GROUP_SIZE}
max_new_tokens = 6
[envs.algorithm.advantage]
type = "{TYPE}"
scale = 2.0
''')


def test_a_user_algorithm_trains_through_the_loop(tmp_path, tiny_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecated spelling, no group-of-one warning
        config = _config(tmp_path, tiny_dir)
    # rewards 0.5, 0.0, 0.5 in every group: RLOO advantages 0.25, -0.5, 0.25, times scale 2
    trainer = Trainer(config, environments={"scripted": ScriptedEnv(rising=False)})
    algo = trainer.runtimes[0].algorithm
    assert type(algo) is LeaveOneOut  # built from the config: nothing patched in
    trained = []
    real_update = trainer.learner.update

    def recording_update(batches, step):
        trained.append([s for b in batches for s in b.samples])
        return real_update(batches, step)

    trainer.learner.update = recording_update
    result = trainer.run()

    assert result.steps == STEPS
    # per step: one group stage per task, then one ship-time call (the batch fits one chunk)
    assert algo.calls == (["finalize_group"] * TASKS_PER_STEP + ["score_samples"]) * STEPS
    assert [len(samples) for samples in trained] == [TASKS_PER_STEP * GROUP_SIZE] * STEPS
    for samples in trained:
        for sample in samples:
            expected = {0.5: 0.5, 0.0: -1.0}[sample.metadata["reward"]]
            live = {a for a, m in zip(sample.advantages, sample.loss_mask) if m}
            assert live == ({expected} if any(sample.loss_mask) else set())
            assert sample.source == TYPE and sample.metadata["scored"] is True
    rows = [r for r in result.metrics if "tokens/rl" in r]
    assert len(rows) == STEPS and all(r["tokens/rl"] > 0 for r in rows)


def test_a_user_algorithm_that_raises_is_named_in_one_line(tmp_path, tiny_dir):
    trainer = Trainer(_config(tmp_path, tiny_dir), environments={"scripted": ScriptedEnv()})
    algo = trainer.runtimes[0].algorithm

    def broken(group, samples):
        raise KeyError("reward_model")

    algo.finalize_group = broken
    with pytest.raises(UsageError) as raised:
        trainer.collect()
    assert str(raised.value) == (
        f"envs.0.algorithm.advantage.type = {TYPE!r} raised KeyError: 'reward_model' "
        "(in process_group(group) or score(samples))"
    )
