"""process_group() of the rl / ce algorithms on hand-made rollouts: exact streams, packable."""

from __future__ import annotations

import pytest

from composer_replication.algo import AlgorithmConfig, build_algorithm
from composer_replication.algo.custom import CustomAlgorithm
from composer_replication.algo.echo import EchoAlgorithm
from composer_replication.samples.rollouts import Rollout
from composer_replication.samples.wire import pack_samples

PROMPT = [5, 6, 7]


def _rollout(reward, completion=(10, 11, 12), logprobs=(-0.5, -0.25, -0.125), **kw):
    return Rollout(
        task_id="t1",
        prompt_ids=list(PROMPT),
        completion_ids=list(completion),
        inference_logprobs=list(logprobs),
        reward=reward,
        **kw,
    )


def _multi_turn(reward, roles=("assistant", "assistant", "tool", "tool", "assistant")):
    # two sampled tokens, a two-token tool observation, one more sampled token
    return _rollout(
        reward,
        completion=(10, 11, 20, 21, 12),
        logprobs=(-0.5, -0.25, 0.0, 0.0, -0.125),
        completion_mask=[1, 1, 0, 0, 1],
        token_roles=list(roles),
    )


def _check_packable(samples):
    for s in samples:
        s.check_alignment()
    batches = pack_samples(samples, max_tokens=64, split=None)
    assert sum(b.n_rows for b in batches) == sum(1 for s in samples if s.input_ids)
    return batches


def _build(advantage, **sampling):
    return build_algorithm(AlgorithmConfig(sampling=sampling, advantage=advantage))


def test_rollout_to_sample_layout():
    (sample,) = _build({"type": "reward"}).process_group([_multi_turn(1.0)])
    assert sample.input_ids == [5, 6, 7, 10, 11, 20, 21, 12]
    assert sample.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert sample.inference_logprobs == [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -0.125]
    assert (sample.task_id, sample.source, sample.metadata) == ("t1", "reward", {"reward": 1.0})


def test_grpo_assign():
    group = [_rollout(1.0), _multi_turn(0.0), _rollout(0.0), _rollout(1.0)]
    samples = _build({"type": "grpo"}).process_group(group)
    assert [s.advantages for s in samples] == [
        [0, 0, 0, 0.5, 0.5, 0.5],
        [0, 0, 0, -0.5, -0.5, 0, 0, -0.5],
        [0, 0, 0, -0.5, -0.5, -0.5],
        [0, 0, 0, 0.5, 0.5, 0.5],
    ]
    assert all(s.rl_weights is None and s.ce_weights is None for s in samples)
    (batch,) = _check_packable(samples)
    assert batch.rl_weights.sum().item() == 3 + 3 + 3 + 3  # weight 1 on every sampled token


def test_grpo_std_normalize_and_length_penalty():
    group = [_rollout(1.0, completion=(1,) * 4, logprobs=(0.0,) * 4), _rollout(1.0)]
    # lengths 4 and 3, target 2: penalties 0.5 * 2/2 = 0.5 and 0.5 * 1/2 = 0.25
    algo = _build({"type": "grpo", "length_penalty": 0.5, "length_target": 2})
    assert algo.group_advantages(group) == [-0.125, 0.125]
    samples = algo.process_group(group)
    assert samples[0].advantages == [0, 0, 0, -0.125, -0.125, -0.125, -0.125]
    std_algo = _build({"type": "grpo", "std_normalize": True})
    a = std_algo.group_advantages([_rollout(2.0), _rollout(0.0)])
    assert a == [1 / (2**0.5 + 1e-6), -1 / (2**0.5 + 1e-6)]


def test_max_rl_assign():
    group = [_rollout(1.0), _rollout(0.0), _rollout(0.0), _rollout(0.0)]
    samples = _build({"type": "max_rl"}).process_group(group)
    hi, lo = 0.75 / (0.25 + 1e-6), -0.25 / (0.25 + 1e-6)
    assert samples[0].advantages == [0, 0, 0, hi, hi, hi]
    assert samples[3].advantages == [0, 0, 0, lo, lo, lo]
    unsolved = _build({"type": "max_rl"}).process_group([_rollout(0.0), _rollout(0.0)])
    assert [s.advantages for s in unsolved] == [[0.0] * 6] * 2
    _check_packable(samples + unsolved)


def test_reward_assign_is_the_raw_reward():
    samples = _build({"type": "reward"}, group_size=1).process_group([_multi_turn(0.75)])
    assert samples[0].advantages == [0, 0, 0, 0.75, 0.75, 0, 0, 0.75]
    _check_packable(samples)
    with pytest.raises(ValueError, match="not finite"):
        _build({"type": "reward"}).process_group([_rollout(float("inf"))])


def test_custom_via_import_path():
    algo = _build(
        {
            "type": "custom",
            "import_path": "composer_replication.algo.custom:reward_per_token",
            "kwargs": {"scale": 0.5},
        }
    )
    samples = algo.process_group([_rollout(1.0), _multi_turn(0.5)])
    assert samples[0].advantages == [0, 0, 0, 0.5, 0.5, 0.5]
    # observation tokens get 0.0 whatever the function returned
    assert samples[1].advantages == [0, 0, 0, 0.25, 0.25, 0, 0, 0.25]
    _check_packable(samples)


def test_custom_takes_advantage_inputs_and_broadcasts_group_credit():
    from composer_replication.algo import AdvantageInputs

    seen = []

    def centred(inputs: AdvantageInputs, *, scale: float) -> list[list[float]]:
        seen.append((type(inputs), inputs.rewards, inputs.completion_lengths))
        mean = sum(inputs.rewards) / len(inputs)
        return inputs.broadcast([scale * (r - mean) for r in inputs.rewards])

    config = AlgorithmConfig(
        advantage={"type": "custom", "import_path": "x.y:z", "kwargs": {"scale": 2.0}}
    )
    samples = CustomAlgorithm(config, fn=centred).process_group([_rollout(1.0), _multi_turn(0.0)])
    assert seen == [(AdvantageInputs, [1.0, 0.0], [3, 5])]
    assert samples[0].advantages == [0, 0, 0, 1.0, 1.0, 1.0]
    assert samples[1].advantages == [0, 0, 0, -1.0, -1.0, 0, 0, -1.0]  # observations 0
    inputs = AdvantageInputs([_rollout(1.0), _rollout(0.5)])
    assert inputs.broadcast([1, 2]) == [[1.0] * 3, [2.0] * 3]
    assert [r.reward for r in inputs] == [1.0, 0.5] and inputs[1].reward == 0.5
    with pytest.raises(ValueError, match="one value per rollout of the group: got 1 values"):
        inputs.broadcast([1.0])


def _custom(fn):
    config = AlgorithmConfig(advantage={"type": "custom", "import_path": "x.y:z"})
    return CustomAlgorithm(config, fn=fn)


def test_custom_per_token_values_and_kwargs():
    seen = {}

    def fn(group, **kwargs):
        seen.update(kwargs)
        return [[0.1, 0.2, 0.3], [1.0, 2.0, 3.0, 4.0, 5.0]]

    config = AlgorithmConfig(
        advantage={"type": "custom", "import_path": "x.y:z", "kwargs": {"k": 1}}
    )
    samples = CustomAlgorithm(config, fn=fn).process_group([_rollout(0.0), _multi_turn(0.0)])
    assert seen == {"k": 1}
    assert samples[0].advantages == [0, 0, 0, 0.1, 0.2, 0.3]
    assert samples[1].advantages == [0, 0, 0, 1.0, 2.0, 0.0, 0.0, 5.0]


def test_custom_wrong_shapes_are_rejected():
    group = [_rollout(0.0), _multi_turn(0.0)]
    with pytest.raises(ValueError, match="returned 1 lists for a group of 2 rollouts"):
        _custom(lambda g: [[0.0, 0.0, 0.0]]).process_group(group)
    with pytest.raises(ValueError, match=r"rollout 1 \('t1'\) has 5 completion tokens but 3"):
        _custom(lambda g: [[0.0] * 3, [0.0] * 3]).process_group(group)
    with pytest.raises(ValueError, match=r"non-finite advantages at completion tokens \[1\]"):
        _custom(lambda g: [[0.0, float("nan"), 0.0], [0.0] * 5]).process_group(group)


def test_a_custom_advantage_that_raises_or_returns_no_numbers_is_one_line_naming_it():
    from composer_replication.common.errors import UsageError

    group = [_rollout(0.0), _multi_turn(0.0)]

    def broken(inputs):
        raise ZeroDivisionError("division by zero")

    with pytest.raises(UsageError) as err:
        _custom(broken).process_group(group)
    assert "raised ZeroDivisionError: division by zero (it is called as fn(inputs" in str(err.value)
    with pytest.raises(UsageError, match=r"rollout 0 .* not numbers"):
        _custom(lambda g: [["a", "b", "c"], [0.0] * 5]).process_group(group)


def test_custom_unimportable_function_fails_at_build():
    config = AlgorithmConfig(advantage={"type": "custom", "import_path": "no_such_pkg.mod:fn"})
    with pytest.raises(ValueError, match=r"cannot import 'no_such_pkg\.mod:fn'"):
        build_algorithm(config)


def test_sft_assign_is_ce_on_sampled_tokens():
    config = AlgorithmConfig(
        sampling={"source": {"name": "t", "base_url": "http://x/v1"}},
        advantage={"type": "sft", "ce_weight": 0.5},
    )
    (sample,) = build_algorithm(config).process_group([_multi_turn(0.0)])
    assert sample.ce_weights == [0, 0, 0, 0.5, 0.5, 0, 0, 0.5]
    assert sample.rl_weights == [0.0] * 8
    assert sample.advantages is None
    assert sample.n_live_rl_tokens == 0
    (batch,) = _check_packable([sample])
    assert batch.rl_weights.sum().item() == 0


def test_echo_assign_weights_observations_per_role():
    algo = _build({"type": "echo", "roles": {"tool": {"alpha": 0.1}, "user": {"alpha": 0.5}}})
    roles = ("assistant", "assistant", "tool", "user", "assistant")
    group = [_multi_turn(1.0), _multi_turn(0.0, roles=roles), _rollout(0.0)]
    samples = algo.process_group(group)
    a = 1.0 - 1.0 / 3.0  # r - mean, as computed
    assert samples[0].advantages == [0, 0, 0, a, a, 0, 0, a]
    assert samples[0].ce_weights == [0, 0, 0, 0, 0, 0.1, 0.1, 0]
    assert samples[1].ce_weights == [0, 0, 0, 0, 0, 0.1, 0.5, 0]
    assert samples[2].ce_weights is None  # no observation tokens
    assert algo.observation_weights(group[1]) == [0, 0, 0.1, 0.5, 0]
    (batch,) = _check_packable(samples)
    row = next(i for i, s in enumerate(batch.samples) if s is samples[1])
    assert batch.loss_mask[row].tolist() == [0, 0, 0, 1, 1, 0, 0, 1]
    assert batch.ce_weights[row].tolist() == pytest.approx([0, 0, 0, 0, 0, 0.1, 0.5, 0])


def test_echo_filter_keep_mask_and_missing_roles():
    config = AlgorithmConfig(advantage={"type": "echo"})
    algo = EchoAlgorithm(
        config, filter_fn=lambda r: [[r.reward > 0] * len(step) for step in r.trajectory]
    )
    samples = algo.process_group([_multi_turn(1.0), _multi_turn(0.0)])
    assert samples[0].ce_weights == [0, 0, 0, 0, 0, 0.1, 0.1, 0]
    assert samples[1].ce_weights is None  # filtered out: rl credit only
    assert samples[1].advantages == [0, 0, 0, -0.5, -0.5, 0, 0, -0.5]
    # observation tokens without role attribution: an error, never a silent no-ce run
    no_roles = _rollout(0.0, completion_mask=[1, 0, 1])
    with pytest.raises(ValueError, match=r"1 observation tokens .* but no token_roles"):
        algo.observation_weights(no_roles)
    # a single-turn rollout (nothing observed) needs no roles
    assert algo.observation_weights(_rollout(0.0)) == [0.0, 0.0, 0.0]


def test_base_checks_and_defaults():
    algo = _build({"type": "grpo"})
    with pytest.raises(ValueError, match="empty group"):
        algo.process_group([])
    other = Rollout("t2", [1], [2], [0.0])
    with pytest.raises(ValueError, match=r"task ids \['t1', 't2'\]"):
        algo.process_group([_rollout(0.0), other])
    assert algo.observation_weights(_multi_turn(0.0)) == [0.0] * 5
    assert algo.components == ("rl",)
    assert algo.advantage_config.loss_requirements() == {}
    assert algo.advantage_config.teacher_mode is None
    with pytest.raises(ValueError, match=r"needs advantage\.type = 'echo'"):
        EchoAlgorithm(AlgorithmConfig())
