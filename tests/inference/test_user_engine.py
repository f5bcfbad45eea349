"""A user's inference engine, named by import path in ``[inference]``: the loop builds it
from its factory, samples through it and hands it every optimizer step, never asking what
it is. The engine is one module (tests/examples/lagged_engine.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tests.examples.lagged_engine import LaggedEngine

from composer_replication.common.errors import UsageError
from composer_replication.config import RunConfig
from composer_replication.samples.rollouts import POLICY_VERSION_KEY
from composer_replication.training.loop import Trainer

sys.path.insert(0, str(Path(__file__).parents[1] / "training"))
from scripted_env import ScriptedEnv, scripted_run_toml

ENGINE = "tests.examples.lagged_engine:lagged_engine"


def _config(tmp_path, tiny_dir, engine: str = ENGINE, every: int = 2) -> RunConfig:
    inference = f'[inference]\nengine = "{engine}"\noptions = {{ every = {every} }}'
    return RunConfig.from_toml(
        scripted_run_toml(
            tmp_path / "run", tiny_dir, steps=3, advantage='type = "grpo"', sections=inference
        )
    )


def test_a_user_engine_samples_and_follows_the_optimizer_its_own_way(tmp_path, tiny_dir):
    trainer = Trainer(_config(tmp_path, tiny_dir), environments={"scripted": ScriptedEnv()})
    assert type(trainer.engine) is LaggedEngine and trainer.engine.every == 2
    versions: list[set[int]] = []
    real_assign = trainer.assign

    def recording_assign(tasks, env_groups, t0):
        out = real_assign(tasks, env_groups, t0)  # stamps each rollout with its version
        versions.append(
            {r.metadata[POLICY_VERSION_KEY] for groups in env_groups for g in groups for r in g}
        )
        return out

    trainer.assign = recording_assign
    result = trainer.run()
    assert result.steps == 3
    # the copy takes the weights after step 2 only: steps 1 and 2 sample version 0, step 3
    # version 2
    assert trainer.engine.synced_at == [2]
    assert versions == [{0}, {0}, {2}]
    rows = [r for r in result.metrics if "engine/synced" in r]
    assert [r["engine/synced"] for r in rows] == [0.0, 1.0, 0.0]
    assert all(r["tokens/rl"] > 0 for r in rows)
    assert trainer.engine.copy is None  # stopped with the run


def test_a_bad_user_engine_is_one_line_naming_it(tmp_path, tiny_dir):
    from composer_replication.preflight import check_inference_engine

    missing = _config(tmp_path, tiny_dir, engine="tests.examples.lagged_engine:nope")
    with pytest.raises(
        UsageError,
        match=r"inference.engine \(a user's engine factory\): module 'tests.examples.lagged_engine' has no 'nope'",
    ):
        check_inference_engine(missing.inference)
    # a module that fails while it imports: the setting, the path and the error's last line
    (tmp_path / "broken_engine_module.py").write_text(
        "raise RuntimeError('line one\\nthe cause')\n"
    )
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        broken = _config(tmp_path, tiny_dir, engine="broken_engine_module:factory")
        with pytest.raises(UsageError) as failed:
            check_inference_engine(broken.inference)
    finally:
        sys.path.remove(str(tmp_path))
    assert str(failed.value) == (
        "inference.engine (a user's engine factory): module 'broken_engine_module' of "
        "'broken_engine_module:factory' fails at import (RuntimeError: the cause); fix the module"
    )
    # the factory raises (the class is not a factory): its error, and how it is called
    raising = _config(tmp_path, tiny_dir, engine="tests.examples.lagged_engine:LaggedEngine")
    with pytest.raises(UsageError, match=r"raised TypeError: .*\(it is called as factory\(config"):
        Trainer(raising, environments={"scripted": ScriptedEnv()})
    # the factory returns something that is not an engine
    other = _config(tmp_path, tiny_dir, engine="builtins:dict")
    with pytest.raises(UsageError, match=r"returned dict, which lacks after_step, "):
        Trainer(other, environments={"scripted": ScriptedEnv()})
    with pytest.raises(ValueError, match=r"options.every = 0 must be >= 1"):
        Trainer(_config(tmp_path, tiny_dir, every=0), environments={"scripted": ScriptedEnv()})


def test_a_user_engine_whose_sampler_raises_is_named_in_one_line(tmp_path, tiny_dir, monkeypatch):
    from composer_replication.inference.in_process import InProcessSampler

    def broken(*args, **kwargs):
        raise ConnectionError("the server went away\nretry later")

    monkeypatch.setattr(InProcessSampler, "sample_batch", broken)  # the engine samples with it
    trainer = Trainer(_config(tmp_path, tiny_dir), environments={"scripted": ScriptedEnv()})
    with pytest.raises(UsageError) as raised:
        trainer.run()
    message = str(raised.value)
    assert message.startswith(
        f"inference.engine = {ENGINE!r} raised ConnectionError: the server went away "
        "(its sampler is called as sample_batch(tokenizer, prompts, settings"
    )
    assert "\n" not in message
