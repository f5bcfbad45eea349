"""``first_step`` / ``last_step`` of an ``[[envs]]`` entry: the steps it samples on.

The config refuses an entry that would never sample and a run with a step no entry samples
on; the native loop picks no tasks for an entry outside its steps and samples nothing for
it. The realistic pair: sft on the reference solutions as a warm start on step 1, grpo
on the policy's own rollouts from step 2.
"""

from __future__ import annotations

import pytest

from composer_replication.config import RunConfig
from composer_replication.config.run import EnvConfig
from composer_replication.envs.python_functions import PythonFunctionsEnv
from composer_replication.rollout.demonstrations import ReferenceSolutions
from composer_replication.safety import HeldoutSplit
from composer_replication.training.loop import train

SFT_ON_REFERENCES = {"sampling": {"source": "reference"}, "advantage": {"type": "sft"}}
GRPO = {"sampling": {"group_size": 2, "max_new_tokens": 8}, "advantage": {"type": "grpo"}}


def _warm_start(steps: int = 3, **run) -> dict:
    demo = {
        "name": "python_functions",
        "tasks_per_step": 3,
        "algorithm": SFT_ON_REFERENCES,
        "last_step": 1,
    }
    rl = {"name": "python_functions", "tasks_per_step": 2, "algorithm": GRPO, "first_step": 2}
    return {"steps": steps, "envs": [demo, rl], **run}


# ------------------------------------------------------------------ config


def test_an_entry_is_active_from_its_first_to_its_last_step():
    always = EnvConfig()
    assert (always.first_step, always.last_step) == (1, None)
    assert all(always.active_at(step) for step in (1, 2, 1000))
    window = EnvConfig(first_step=2, last_step=4)
    assert [window.active_at(step) for step in range(1, 7)] == [
        False, True, True, True, False, False,
    ]  # fmt: skip
    single = EnvConfig(first_step=3, last_step=3)
    assert [single.active_at(step) for step in range(1, 5)] == [False, False, True, False]
    later = EnvConfig(first_step=5)
    assert [later.active_at(step) for step in (4, 5, 50)] == [False, True, True]


def test_an_entry_that_would_never_sample_is_refused():
    with pytest.raises(
        ValueError,
        match="environment 'python_functions': last_step = 1 is before first_step = 2; the "
        "entry would never sample",
    ):
        EnvConfig(first_step=2, last_step=1)
    for bad in ({"first_step": 0}, {"last_step": 0}):
        with pytest.raises(ValueError, match="greater than or equal to 1"):
            EnvConfig(**bad)


def test_a_run_with_a_step_no_entry_samples_on_is_refused():
    with pytest.raises(
        ValueError,
        match=r"no environment entry samples on step 2, 3 of 3: change the entries' "
        "first_step / last_step",
    ):
        RunConfig.model_validate({"steps": 3, "envs": [{"last_step": 1}]})
    gap = _warm_start(steps=5)
    gap["envs"][1] = dict(gap["envs"][1], first_step=3)
    with pytest.raises(ValueError, match=r"samples on step 2 of 5:"):
        RunConfig.model_validate(gap)
    late = {"steps": 12, "envs": [{"first_step": 9}]}
    with pytest.raises(ValueError, match=r"samples on step 1, 2, 3, 4, 5, \.\.\. of 12:"):
        RunConfig.model_validate(late)


def test_a_warm_start_hands_over_from_one_entry_to_the_other():
    cfg = RunConfig.model_validate(_warm_start())
    demo, rl = cfg.envs
    assert (demo.first_step, demo.last_step) == (1, 1)
    assert (rl.first_step, rl.last_step) == (2, None)
    assert demo.algorithm.advantage.type == "sft" and rl.algorithm.advantage.type == "grpo"
    assert [[e.active_at(step) for e in cfg.envs] for step in (1, 2, 3)] == [
        [True, False],
        [False, True],
        [False, True],
    ]
    toml = """
steps = 3

[[envs]]
name = "python_functions"
tasks_per_step = 3
last_step = 1
algorithm = { sampling = { source = "reference" }, advantage = { type = "sft" } }

[[envs]]
name = "python_functions"
tasks_per_step = 2
first_step = 2
algorithm = { sampling = { group_size = 2, max_new_tokens = 8 }, advantage = { type = "grpo" } }
"""
    assert RunConfig.from_toml(toml).envs == cfg.envs
    # the entries differ only in their steps: not one entry repeated
    same = {"name": "python_functions", "algorithm": GRPO}
    two = {"steps": 2, "envs": [dict(same, last_step=1), dict(same, first_step=2)]}
    assert len(RunConfig.model_validate(two).envs) == 2


# ------------------------------------------------------------------ a run


class StepRecordingEnv(PythonFunctionsEnv):
    """python_functions recording each request in order: (kind, task ids)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls: list[tuple[str, list[str]]] = []

    def sample(self, policy, tokenizer, task_ids, *, group_size, sampling, **kwargs):
        assert not isinstance(policy, ReferenceSolutions)
        kind = "eval" if sampling.temperature == 0 else "train"
        self.calls.append((kind, list(task_ids)))
        return super().sample(
            policy, tokenizer, task_ids, group_size=group_size, sampling=sampling, **kwargs
        )

    def demonstrations(self, tokenizer, task_ids, *, group_size=1):
        self.calls.append(("demonstrations", list(task_ids)))
        return super().demonstrations(tokenizer, task_ids, group_size=group_size)


def test_each_entry_samples_only_on_its_own_steps(tmp_path, tiny_dir):
    cfg = RunConfig.model_validate(
        _warm_start(
            seed=0,
            output_dir=str(tmp_path / "warm"),
            model={"source": tiny_dir, "lora": {"r": 4, "alpha": 8}},
            optim={"lr": 1e-2},
            eval={
                "every": 3,
                "at_start": False,
                "max_tasks": 1,
                "samples_per_task": 1,
                "temperature": 0,
                "greedy": False,
            },
        )
    )
    env = StepRecordingEnv()
    result = train(cfg, environments={"python_functions": env})
    assert result.steps == 3
    # step 1: the demonstration entry only; steps 2 and 3: the grpo entry only; then the
    # evaluation after step 3
    assert [kind for kind, _ in env.calls] == ["demonstrations", "train", "train", "eval"]
    assert [len(ids) for _, ids in env.calls] == [3, 2, 2, 1]
    train_ids, heldout_ids = HeldoutSplit(0.25, "composer-replication").split(env.task_ids())
    assert all(set(ids) <= set(train_ids) for kind, ids in env.calls if kind != "eval")
    assert set(env.calls[-1][1]) <= set(heldout_ids)

    rows = {r["step"]: r for r in result.metrics if "rollouts/count" in r}
    assert sorted(rows) == [1, 2, 3]
    assert rows[1]["rollouts/demonstrations"] == 3.0
    assert rows[1]["rollouts/count"] == 0.0  # nothing sampled from the policy on step 1
    assert rows[1]["tokens/ce"] > 0
    for step in (2, 3):
        assert "rollouts/demonstrations" not in rows[step]
        assert rows[step]["rollouts/count"] == 4.0  # 2 tasks x group_size 2
        assert rows[step]["tokens/ce"] == 0.0
