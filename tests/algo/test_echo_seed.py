"""echo to the letter: the filter is ``filter_fn(rollout, **kwargs) -> list[list[bool]]`` (one
keep-mask per trajectory step), and echo without role attribution is rejected when the
config is validated (or, for an environment the config cannot know, at assign time) instead
of training no ce tokens."""

from __future__ import annotations

import textwrap

import pytest
from pydantic import ValidationError

from composer_replication.algo import AlgorithmConfig, EchoAdvantage, EchoFilter, build_algorithm
from composer_replication.algo.echo import EchoAlgorithm
from composer_replication.config import RunConfig
from composer_replication.samples.rollouts import Rollout

PROMPT = [5, 6, 7]
TOOL_TURN = ("assistant", "assistant", "tool", "tool", "assistant")
TURN_2 = ("assistant", "tool", "tool")


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


def _per_step(rollout, keep):
    """One keep-mask per trajectory step, each spanning prompt_ids + completion_ids."""
    return [[keep] * (len(s.prompt_ids) + len(s.completion_ids)) for s in rollout.trajectory]


def test_filter_is_called_per_rollout_with_kwargs_and_returns_a_mask_per_step():
    calls = []

    def keep_rewarded(rollout, *, min_reward, **rest):
        calls.append((rollout.reward, min_reward, rest))
        return _per_step(rollout, rollout.reward >= min_reward)

    config = _echo(filter={"import_path": "unused.module:fn", "kwargs": {"min_reward": 0.5}})
    algo = EchoAlgorithm(config, filter_fn=keep_rewarded)
    group = [_turn(1.0), _turn(0.0), _turn(0.5), _turn(0.25)]
    # _turn: step 0 = prompt (3) + [10, 11, 20, 21]; step 1 = prompt + those (7) + [12]
    assert [len(m) for m in algo.keep_masks(group[0])] == [7, 8]
    calls.clear()
    samples = algo.process_group(group)
    assert calls == [(1.0, 0.5, {}), (0.0, 0.5, {}), (0.5, 0.5, {}), (0.25, 0.5, {})]
    tool = [0, 0, 0, 0, 0, 0.1, 0.1, 0]
    assert [s.ce_weights for s in samples] == [tool, None, tool, None]
    # rl credit is untouched by the filter: Dr.GRPO r - mean on the sampled tokens
    mean = (1.0 + 0.0 + 0.5 + 0.25) / 4
    for s, r in zip(samples, (1.0, 0.0, 0.5, 0.25)):
        a = r - mean
        assert s.advantages == pytest.approx([0, 0, 0, a, a, 0, 0, a])


def test_each_step_mask_selects_the_observation_tokens_of_that_step():
    # three turns: [a a | tool tool] [a | tool tool] [a]
    rollout = Rollout(
        task_id="t1",
        prompt_ids=list(PROMPT),
        completion_ids=[10, 11, 20, 21, 12, 22, 23, 13],
        inference_logprobs=[-0.5, -0.25, 0.0, 0.0, -0.125, 0.0, 0.0, -1.0],
        completion_mask=[1, 1, 0, 0, 1, 0, 0, 1],
        token_roles=[*("assistant", "assistant", "tool", "tool"), *TURN_2, "assistant"],
        reward=1.0,
    )
    steps = rollout.trajectory
    assert [s.completion_ids for s in steps] == [[10, 11, 20, 21], [12, 22, 23], [13]]
    assert [s.start for s in steps] == [0, 4, 7]
    assert steps[1].prompt_ids == [*PROMPT, 10, 11, 20, 21]

    def drop_token_22(rollout):
        # a token-level filter: keep everything but the observation token 22 (step 1)
        return [
            [tok != 22 for tok in (*s.prompt_ids, *s.completion_ids)] for s in rollout.trajectory
        ]

    algo = EchoAlgorithm(_echo(roles={"tool": {"alpha": 0.5}}), filter_fn=drop_token_22)
    # step 2's prompt holds 22 again: only each step's completion span is read
    assert algo.token_keep(rollout) == [True] * 5 + [False, True, True]
    (sample,) = algo.process_group([rollout])
    assert sample.ce_weights == [0, 0, 0, 0, 0, 0.5, 0.5, 0, 0, 0.5, 0]


def test_filter_from_the_config_import_path_and_kwargs(tmp_path, monkeypatch):
    (tmp_path / "echo_filters.py").write_text(
        textwrap.dedent(
            """
            def drop_warnings(rollout, *, pattern, **kwargs):
                keep = pattern not in (rollout.feedback or "")
                return [[keep] * (len(s.prompt_ids) + len(s.completion_ids))
                        for s in rollout.trajectory]
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
    assert algo.token_keep(group[0]) == [False] * 5 and algo.token_keep(group[1]) == [True] * 5
    samples = algo.process_group(group)
    assert samples[0].ce_weights is None
    assert samples[1].ce_weights == [0, 0, 0, 0, 0, 0.25, 0.25, 0]


def test_without_a_filter_every_token_is_kept():
    algo = build_algorithm(_echo())
    assert algo.filter_fn is None
    assert algo.keep_masks(_turn(0.0)) == [[True] * 7, [True] * 8]
    assert algo.token_keep(_turn(1.0)) == [True] * 5


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (True, r"one keep-mask per trajectory step .*2 steps.*; got bool"),
        ([[True] * 7], "got 1 masks"),
        ([[True] * 7, [True] * 8, [True]], "got 3 masks"),
        ([[True] * 3, [True] * 8], "step 0's mask has 3 entries for 7 tokens"),
        ([[True, 1] + [True] * 5, [True] * 8], r"step 0's mask entry 1 is 1 \(int\), not a bool"),
        ([True, True], "step 0's mask is bool"),
        ("ok", "got str"),
        (None, "got NoneType"),
    ],
)
def test_a_filter_must_return_one_mask_per_step(returned, message):
    algo = EchoAlgorithm(_echo(), filter_fn=lambda rollout, **kw: returned)
    with pytest.raises(ValueError, match=message):
        algo.process_group([_turn(1.0), _turn(0.0)])


def test_numpy_masks_and_bools_are_accepted():
    np = pytest.importorskip("numpy")

    def low_probability_observations_only(rollout):
        return [
            np.ones(len(s.prompt_ids) + len(s.completion_ids), dtype=bool)
            for s in rollout.trajectory
        ]

    algo = EchoAlgorithm(_echo(), filter_fn=low_probability_observations_only)
    assert algo.token_keep(_turn(1.0)) == [True] * 5
    flags = np.array([True, False])
    algo = EchoAlgorithm(_echo(), filter_fn=lambda r: [[flags[0]] * 7, [flags[1]] * 8])
    assert algo.token_keep(_turn(1.0)) == [True] * 4 + [False]


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
        algo.process_group([_turn(1.0), _turn(0.0, roles=None)])
    # a single-turn rollout (no observation token) needs no roles: rl only, no ce
    single = Rollout("t1", list(PROMPT), [10, 11], [-0.5, -0.25], reward=1.0)
    samples = algo.process_group([single, _turn(0.0)])
    assert samples[0].ce_weights is None
    assert samples[1].ce_weights == [0, 0, 0, 0, 0, 0.1, 0.1, 0]
