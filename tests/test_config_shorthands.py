"""The advantage shorthands: a run-level [advantage] table and a per-environment
``advantage = {...}``, through the real TOML loader; precedence, the resolved dump (full
algorithm, no shorthand) and the one-line conflict error."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from composer_replication.common.errors import user_error
from composer_replication.config import RunConfig


def _load(tmp_path, text: str, overrides: list[str] | None = None) -> RunConfig:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return RunConfig.from_toml(path, overrides)


def _error(tmp_path, text: str, overrides: list[str] | None = None) -> str:
    with pytest.raises(ValidationError) as info:
        _load(tmp_path, text, overrides)
    return user_error(info.value)


def test_run_level_table_is_the_default_environments_advantage(tmp_path):
    cfg = _load(tmp_path, '[advantage]\ntype = "grpo"\nstd_normalize = true\n')
    default = RunConfig.default()
    (env,) = cfg.envs
    assert env.algorithm.advantage.type == "grpo" and env.algorithm.advantage.std_normalize
    # only the advantage changes: sampling and the rest of the default environment stay
    assert env.algorithm.sampling == default.envs[0].algorithm.sampling
    assert env.tasks_per_step == default.envs[0].tasks_per_step
    assert default.envs[0].algorithm.advantage.type == "composer"


def test_per_environment_shorthand_wins_over_the_run_level_table(tmp_path):
    cfg = _load(
        tmp_path,
        """
[advantage]
type = "sdpo"
alpha_sdpo = 0.5

[[envs]]
name = "python_functions"

[[envs]]
name = "python_functions"
tasks_per_step = 2
advantage = { type = "max_rl", eps = 0.001 }

[[envs]]
name = "python_functions"
tasks_per_step = 3
[envs.algorithm.advantage]
type = "reward"
""",
    )
    inherited, own_shorthand, own_table = (e.algorithm.advantage for e in cfg.envs)
    assert (inherited.type, inherited.alpha_sdpo) == ("sdpo", 0.5)
    # an environment's own advantage replaces the run-level one whole (no alpha_sdpo merge)
    assert (own_shorthand.type, own_shorthand.eps) == ("max_rl", 0.001)
    assert own_table.type == "reward"


def test_resolved_dump_holds_the_full_algorithm_and_round_trips(tmp_path):
    cfg = _load(
        tmp_path,
        """
[advantage]
type = "grpo"
length_penalty = 0.5
length_target = 40

[[envs]]
name = "python_functions"
advantage = { type = "sdpo", teacher = "initial" }

[[envs]]
name = "python_functions"
tasks_per_step = 2
""",
    )
    dumped = json.loads(cfg.model_dump_json())  # what a run writes to config.json
    assert "advantage" not in dumped
    assert all("advantage" not in env for env in dumped["envs"])
    first, second = (env["algorithm"]["advantage"] for env in dumped["envs"])
    assert first["type"] == "sdpo" and first["teacher"] == "initial"
    assert first["alpha_sdpo"] == 1.0 and first["use_sibling_demos"] is True  # full table
    assert second == {
        "type": "grpo",
        "std_normalize": False,
        "eps": 1e-6,
        "length_penalty": 0.5,
        "length_target": 40,
        "turn_reward_weight": 0.0,
    }
    assert RunConfig.model_validate(dumped) == cfg


def test_shorthand_and_an_agreeing_algorithm_advantage_are_accepted(tmp_path):
    cfg = _load(
        tmp_path,
        """
[[envs]]
name = "python_functions"
advantage = { type = "grpo", std_normalize = true }
[envs.algorithm.advantage]
type = "grpo"
std_normalize = true
eps = 1e-6
""",
    )
    assert cfg.envs[0].algorithm.advantage.std_normalize is True


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        (
            'type = "grpo"\nstd_normalize = false',
            "environment 'python_functions': advantage.std_normalize = True but "
            "algorithm.advantage.std_normalize = False; give the advantage in one place",
        ),
        (
            'type = "max_rl"',
            "environment 'python_functions': advantage.type = 'grpo' but "
            "algorithm.advantage.type = 'max_rl'; give the advantage in one place",
        ),
    ],
)
def test_a_conflicting_shorthand_is_a_one_line_error(tmp_path, table, expected):
    message = _error(
        tmp_path,
        f"""
[[envs]]
name = "python_functions"
advantage = {{ type = "grpo", std_normalize = true }}
[envs.algorithm.advantage]
{table}
""",
    )
    assert "\n" not in message
    assert message.startswith("envs.0: " + expected)


def test_overrides_reach_the_shorthands():
    # a run-level override replaces the default environment's advantage, in either order
    for overrides in (
        ["advantage.type=grpo", "envs.0.tasks_per_step=3"],
        ["envs.0.tasks_per_step=3", "advantage.type=grpo"],
    ):
        cfg = RunConfig.default(overrides)
        assert cfg.envs[0].algorithm.advantage.type == "grpo"
        assert cfg.envs[0].tasks_per_step == 3
    cfg = RunConfig.default(["envs.0.advantage.type=max_rl"])
    assert cfg.envs[0].algorithm.advantage.type == "max_rl"
    # a default advantage the user changed is the environment's own: a run-level table
    # would never replace it, so giving one is an error, not silently ignored; the
    # environment's shorthand must agree with it
    changed = "envs.0.algorithm.advantage.beta_replay=0.5"
    cfg = RunConfig.default([changed])
    assert cfg.envs[0].algorithm.advantage.type == "composer"
    assert cfg.envs[0].algorithm.advantage.beta_replay == 0.5
    with pytest.raises(ValidationError, match="has an advantage of its own"):
        RunConfig.default([changed, "advantage.type=grpo"])
    # a run-level table is whole: a field alone names what is missing
    with pytest.raises(ValidationError, match=r"advantage\.type is missing"):
        RunConfig.default(["advantage.alpha_sdpo=-1"])
    with pytest.raises(ValidationError, match=r"advantage\.type = 'grpo' but algorithm"):
        RunConfig.default([changed, "envs.0.advantage.type=grpo"])


def test_shorthand_feeds_the_algorithm_validation(tmp_path):
    # the folded table is validated as algorithm.advantage: its errors name the fix
    message = _error(tmp_path, '[advantage]\ntype = "grpo"\nlength_penalty = 0.5\n')
    assert "length_penalty = 0.5 needs length_target" in message
    message = _error(tmp_path, '[advantage]\ntype = "no_such_algorithm"\n')
    assert "no_such_algorithm" in message


def test_a_bad_run_level_table_is_named_where_it_was_written(tmp_path):
    # not envs.0.algorithm.advantage: the user wrote [advantage] (or --set advantage.x=...)
    message = _error(tmp_path, '[advantage]\ntype = "grpo"\nbeta_kl = -1\n')
    assert message.startswith("advantage.beta_kl: Extra inputs are not permitted (got -1)")
    assert "envs.0" not in message
    with pytest.raises(
        ValidationError, match=r"advantage: type 'nosuch' is neither a built-in algorithm"
    ) as info:
        RunConfig.default(["advantage.type=nosuch"])
    assert "envs.0" not in str(info.value)
