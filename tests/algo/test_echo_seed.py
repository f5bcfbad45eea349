"""echo to the letter: the filter is ``fn(rollouts, **kwargs) -> list[bool]`` (one keep
flag per rollout of the step), and echo without role attribution is rejected when the
config is validated (or, for an environment the config cannot know, at assign time) instead
of training no ce tokens."""

from __future__ import annotations

import textwrap

import pytest
from pydantic import ValidationError

from composer_replication.algo import AlgorithmConfig, EchoAdvantage, EchoFilter, build_algorithm
from composer_replication.algo.echo import EchoAlgorithm
from composer_replication.config import RunConfig
from composer_replication.rollout.types import Rollout

PROMPT = [5, 6, 7]
TOOL_TURN = ("assistant", "assistant", "tool", "tool", "assistant")


def _turn(reward, *, feedback=None, roles=TOOL_TURN, task="t1"):
    """Two sampled tokens, a two-token observation, one more sampled token."""
    return Rollout(
        task_id=task,
        prompt_ids=list(PROMPT),
        completion_ids=[10, 11, 20, 21, 12],
        inference_logprobs=[-0.5, -0.25, 0.0, 0.0, -0.125],
        completion_mask=[1, 1, 0, 0, 1],
        token_roles=None if roles is None else list(roles),
        reward=reward,
        feedback=feedback,
    )


def _echo(**advantage):
    return AlgorithmConfig(advantage={"type": "echo", **advantage})


# ------------------------------------------------------------------ the filter


def test_filter_returns_a_keep_mask_over_the_step_and_gets_kwargs():
    calls = []

    def keep_rewarded(rollouts, *, min_reward, **rest):
        calls.append(([r.reward for r in rollouts], min_reward, rest))
        return [r.reward >= min_reward for r in rollouts]

    config = _echo(filter={"import_path": "unused.module:fn", "kwargs": {"min_reward": 0.5}})
    algo = EchoAlgorithm(config, filter_fn=keep_rewarded)
    group = [_turn(1.0), _turn(0.0), _turn(0.5), _turn(0.25)]
    assert algo.keep_mask(group) == [True, False, True, False]
    samples = algo.assign(group)
    # one call per keep_mask / assign, with every rollout of the step in order
    assert calls == [([1.0, 0.0, 0.5, 0.25], 0.5, {})] * 2
    tool = [0, 0, 0, 0, 0, 0.1, 0.1, 0]
    assert [s.ce_weights for s in samples] == [tool, None, tool, None]
    # rl credit is untouched by the filter: Dr.GRPO r - mean on the sampled tokens
    mean = (1.0 + 0.0 + 0.5 + 0.25) / 4
    for s, r in zip(samples, (1.0, 0.0, 0.5, 0.25)):
        a = r - mean
        assert s.advantages == pytest.approx([0, 0, 0, a, a, 0, 0, a])


def test_filter_from_the_config_import_path_and_kwargs(tmp_path, monkeypatch):
    (tmp_path / "echo_filters.py").write_text(
        textwrap.dedent(
            """
            def drop_warnings(rollouts, *, pattern, **kwargs):
                return [pattern not in (r.feedback or "") for r in rollouts]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = _echo(
        roles={"tool": {"alpha": 0.25}},
        filter={"import_path": "echo_filters:drop_warnings", "kwargs": {"pattern": "WARNING"}},
    )
    algo = build_algorithm(config)
    group = [_turn(1.0, feedback="WARNING: deprecated"), _turn(0.0, feedback="ok")]
    assert algo.keep_mask(group) == [False, True]
    samples = algo.assign(group)
    assert samples[0].ce_weights is None
    assert samples[1].ce_weights == [0, 0, 0, 0, 0, 0.25, 0.25, 0]


def test_without_a_filter_every_rollout_is_kept():
    algo = build_algorithm(_echo())
    assert algo.filter_fn is None
    assert algo.keep_mask([_turn(0.0), _turn(1.0)]) == [True, True]


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (True, "must return a list of 2 bools .* got bool"),
        ([True], "got 1 values for 2 rollouts"),
        ([True, True, False], "got 3 values for 2 rollouts"),
        ([True, 1], r"entry 1 is 1 \(int\), not a bool"),
        ("ok", "got str"),
        (None, "got NoneType"),
    ],
)
def test_a_filter_must_return_one_bool_per_rollout(returned, message):
    algo = EchoAlgorithm(_echo(), filter_fn=lambda rollouts, **kw: returned)
    with pytest.raises(ValueError, match=message):
        algo.assign([_turn(1.0), _turn(0.0)])


def test_numpy_bools_are_bools():
    np = pytest.importorskip("numpy")
    rewards = np.array([1.0, 0.0])
    algo = EchoAlgorithm(_echo(), filter_fn=lambda rollouts: [rewards[i] > 0 for i in range(2)])
    assert algo.keep_mask([_turn(1.0), _turn(0.0)]) == [True, False]


def test_filter_config_shorthand_and_round_trip():
    short = _echo(filter="pkg.mod:keep")
    assert short.advantage.filter == EchoFilter(import_path="pkg.mod:keep", kwargs={})
    full = _echo(filter={"import_path": "pkg.mod:keep", "kwargs": {"patterns": ["WARN"]}})
    again = AlgorithmConfig.from_toml(full.to_toml())
    assert again == full and again.advantage.filter.kwargs == {"patterns": ["WARN"]}
    with pytest.raises(ValidationError, match="import_path"):
        _echo(filter={"import_path": "not a path"})
    with pytest.raises(ValidationError, match="extra"):
        _echo(filter={"import_path": "pkg.mod:keep", "args": [1]})


def test_unimportable_filter_is_named():
    with pytest.raises(ValueError, match="echo filter: cannot import 'no_such_mod_xyz:f'"):
        build_algorithm(_echo(filter="no_such_mod_xyz:f"))


# ------------------------------------------------------------------ role attribution


def _run(env_name: str, advantage: str = 'type = "echo"') -> RunConfig:
    return RunConfig.from_toml(
        f"""
[[envs]]
name = "{env_name}"
[envs.algorithm.advantage]
{advantage}
"""
    )


def test_echo_on_an_environment_without_role_attribution_fails_validation():
    with pytest.raises(ValidationError) as info:
        _run("python_functions")
    (error,) = info.value.errors()
    assert error["loc"] == ("envs", 0)
    text = str(info.value)
    assert "echo on environment name = 'python_functions'" in text  # the setting
    assert "no role attribution" in text and "token_roles" in text  # why
    assert "feature_deletion" in text and "type = 'grpo'" in text  # the fix


def test_environments_that_attribute_roles_pass_validation():
    assert _run("feature_deletion").envs[0].algorithm.type == "echo"
    # an import-path environment is checked when its rollouts arrive (below)
    assert _run("my_pkg.envs:make").envs[0].algorithm.type == "echo"
    # other algorithms on python_functions are unaffected
    assert _run("python_functions", 'type = "grpo"').envs[0].algorithm.type == "grpo"


@pytest.mark.parametrize(
    "roles",
    [{}, {"tool": {"alpha": 0.0}}, {"tool": {"alpha": 0.0}, "user": {"alpha": 0.0}}],
    ids=["empty", "zero", "all-zero"],
)
def test_echo_with_no_weighted_role_fails_validation(roles):
    with pytest.raises(ValidationError, match=r"advantage\.roles = .* weights no observation"):
        EchoAdvantage(roles=roles)
    with pytest.raises(ValidationError, match=r"advantage\.roles\.tool\.alpha"):
        _echo(roles=roles)


def test_observation_tokens_without_roles_raise_at_assign():
    algo = build_algorithm(_echo())
    with pytest.raises(ValueError, match=r"task 't1' has 2 observation tokens .* no token_roles"):
        algo.assign([_turn(1.0), _turn(0.0, roles=None)])
    # a single-turn rollout (no observation token) needs no roles: rl only, no ce
    single = Rollout("t1", list(PROMPT), [10, 11], [-0.5, -0.25], reward=1.0)
    samples = algo.assign([single, _turn(0.0)])
    assert samples[0].ce_weights is None
    assert samples[1].ce_weights == [0, 0, 0, 0, 0, 0.1, 0.1, 0]
