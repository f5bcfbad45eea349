"""``sampling.source = "reference"``: sft on an environment's reference solutions.

The config accepts it for sft only; python_functions answers each task with its reference
solution (nothing sampled, nothing graded); a run with a demonstration entry beside an rl
entry on the same environment trains ce on exactly the demonstrations' tokens, keeps them
out of the reward (and so out of the kill switch), shows only training tasks' solutions and
evaluates the shared held-out tasks once.
"""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import pytest

from composer_replication.config import RunConfig
from composer_replication.config.algorithm import AlgorithmConfig
from composer_replication.envs.python_functions import PythonFunctionsEnv, reference_demonstration
from composer_replication.rollout.demonstrations import ReferenceSolutions
from composer_replication.safety import HeldoutSplit
from composer_replication.samples.generation import SamplingSettings
from composer_replication.training.loop import train

sys.path.insert(0, str(Path(__file__).parent))
from scripted_env import ScriptedEnv

SFT_ON_REFERENCES = {"sampling": {"source": "reference"}, "advantage": {"type": "sft"}}


def _broken_sandbox(workdir):
    raise OSError("no sandbox: demonstrations must not be graded")


# ------------------------------------------------------------------ config


def test_reference_source_is_for_sft_only():
    cfg = AlgorithmConfig.model_validate(SFT_ON_REFERENCES)
    assert cfg.sampling.source == "reference"
    assert cfg.sampling.group_size == 1  # one solution per task, not the default 4 copies
    with pytest.raises(ValueError, match="group_size = 4 would only repeat it"):
        AlgorithmConfig.model_validate(
            {"sampling": {"source": "reference", "group_size": 4}, "advantage": {"type": "sft"}}
        )
    for algo in ("grpo", "composer", "opsd"):
        with pytest.raises(ValueError, match="feeds only type = 'sft'"):
            AlgorithmConfig.model_validate(
                {"sampling": {"source": "reference"}, "advantage": {"type": algo}}
            )
    with pytest.raises(ValueError, match="'reference'"):  # the fix names the new source
        AlgorithmConfig.model_validate({"advantage": {"type": "sft"}})
    with pytest.raises(ValueError, match="is not 'policy' or 'reference'"):
        AlgorithmConfig.model_validate(
            {"sampling": {"source": "references"}, "advantage": {"type": "sft"}}
        )
    # the model slots of opd / opsd stay models: "reference" is a sampling source only
    with pytest.raises(ValueError, match="is not 'policy'"):
        AlgorithmConfig.model_validate({"advantage": {"type": "opsd", "model": "reference"}})
    assert AlgorithmConfig.from_toml(cfg.to_toml()) == cfg


def _two_entries(second: dict) -> dict:
    first = {
        "name": "python_functions",
        "algorithm": {"sampling": {"temperature": 0.7}, "advantage": {"type": "grpo"}},
    }
    return {"envs": [first, {"name": "python_functions", **second}]}


def test_one_environment_may_feed_an_rl_and_a_demonstration_entry():
    cfg = RunConfig.model_validate(_two_entries({"algorithm": SFT_ON_REFERENCES}))
    # the demonstration entry's temperature (default 1.0) samples nothing: not a conflict
    assert cfg.envs[1].algorithm.sampling.temperature == 1.0
    assert cfg.loss.temperature == 0.7
    with pytest.raises(ValueError, match="repeats an identical entry for \\['python_functions'\\]"):
        RunConfig.model_validate(_two_entries(_two_entries({})["envs"][0]))
    with pytest.raises(ValueError, match="different temperatures"):  # both sample the policy
        RunConfig.model_validate(_two_entries({"algorithm": {"advantage": {"type": "max_rl"}}}))


# ------------------------------------------------------------------ environment


def test_demonstrations_are_the_reference_solutions_ungraded(tokenizer):
    env = PythonFunctionsEnv(sandbox_factory=_broken_sandbox)
    ids = env.task_ids()[:3]
    groups = env.rollouts(
        ReferenceSolutions(),
        tokenizer,
        ids,
        group_size=2,
        sampling=SamplingSettings(max_new_tokens=4, temperature=1.0),
    )
    assert [len(g) for g in groups] == [2, 2, 2]
    for tid, group in zip(ids, groups):
        task = env.tasks[tid]
        for r in group:
            assert r.task_id == tid and r.is_demonstration and r.reward == 1.0
            assert r.prompt_ids == env.prompt_ids(tokenizer, task)
            # the whole solution, then the end of the turn (max_new_tokens does not cut it)
            assert r.completion_ids[-1] == tokenizer.eos_token_id
            assert tokenizer.decode(r.completion_ids[:-1]) == reference_demonstration(task)
            assert r.inference_logprobs == [0.0] * len(r.completion_ids)
            assert r.error is None and r.prompt_messages == env.messages(task)
        assert group[0] is not group[1]  # copies, not one object twice
    with pytest.raises(ValueError, match="unknown python_functions task ids"):
        env.demonstrations(tokenizer, ["no-such-task"])


def test_an_environment_without_reference_solutions_is_rejected(tmp_path, tiny_dir):
    cfg = RunConfig.model_validate(
        {
            "output_dir": str(tmp_path / "run"),
            "model": {"source": tiny_dir},
            "envs": [{"name": "scripted", "algorithm": SFT_ON_REFERENCES}],
        }
    )
    with pytest.raises(ValueError, match="'scripted' gives no reference solutions"):
        train(cfg, environments={"scripted": ScriptedEnv(n_tasks=16)})


# ------------------------------------------------------------------ a run


class RecordingEnv(PythonFunctionsEnv):
    """python_functions that records what each call asked for."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls: list[tuple[str, list[str]]] = []

    def sample(self, policy, tokenizer, task_ids, *, group_size, sampling, **kwargs):
        assert not isinstance(policy, ReferenceSolutions)  # demonstrations are never sampled
        kind = "eval" if sampling.temperature == 0 else "train"
        self.calls.append((kind, list(task_ids)))
        return super().sample(
            policy, tokenizer, task_ids, group_size=group_size, sampling=sampling, **kwargs
        )

    def demonstrations(self, tokenizer, task_ids, *, group_size=1):
        self.calls.append(("demonstrations", list(task_ids)))
        return super().demonstrations(tokenizer, task_ids, group_size=group_size)


def _run_config(tmp_path: Path, tiny_dir: str, *, demonstrations: bool) -> RunConfig:
    rl = {
        "name": "python_functions",
        "tasks_per_step": 2,
        "algorithm": {
            "sampling": {"group_size": 2, "max_new_tokens": 8},
            "advantage": {"type": "grpo"},
        },
    }
    demo = {"name": "python_functions", "tasks_per_step": 3, "algorithm": SFT_ON_REFERENCES}
    return RunConfig.model_validate(
        {
            "seed": 0,
            "steps": 2,
            "output_dir": str(tmp_path / ("mixed" if demonstrations else "rl")),
            "model": {"source": tiny_dir, "lora": {"r": 4, "alpha": 8}},
            "optim": {"lr": 1e-2},
            "eval": {"every": 2, "max_tasks": 2, "samples_per_task": 1, "temperature": 0},
            "envs": [rl, demo] if demonstrations else [rl],
        }
    )


def test_a_run_trains_ce_on_the_demonstrations_beside_rl(tmp_path, tiny_dir, tokenizer):
    env = RecordingEnv()
    result = train(
        _run_config(tmp_path, tiny_dir, demonstrations=True),
        environments={"python_functions": env},
    )
    assert result.steps == 2
    demo_calls = [ids for kind, ids in env.calls if kind == "demonstrations"]
    assert len(demo_calls) == 2 and all(len(ids) == 3 for ids in demo_calls)
    train_ids, heldout_ids = HeldoutSplit(0.25, "composer-replication").split(env.task_ids())
    shown = {t for ids in demo_calls for t in ids}
    assert shown <= set(train_ids) and not shown & set(heldout_ids)
    rows = [r for r in result.metrics if "rollouts/demonstrations" in r]
    assert len(rows) == 2
    for row, ids in zip(rows, demo_calls):
        assert row["rollouts/demonstrations"] == 3
        assert row["rollouts/count"] == 4  # the policy's rollouts only
        # ce on every demonstration token: solution + end of turn
        expected = sum(len(g[0].completion_ids) for g in env.demonstrations(tokenizer, ids))
        assert row["tokens/ce"] == expected
        # the tiny random model writes no function: the reward is the policy's (0), never
        # the demonstrations' 1.0, so the kill switch compares the policy with itself; its
        # groups have no rl credit and leave through the zero-advantage filter
        assert row["reward/mean"] == 0.0
        assert row["rollouts/zero_advantage"] == 4 and row["tokens/rl"] == 0

    # held-out tasks are evaluated once per evaluation, as in a run without the demonstration
    # entry (the two entries share the environment and its held-out split)
    evals = [ids for kind, ids in env.calls if kind == "eval"]
    rl_only = RecordingEnv()
    train(
        _run_config(tmp_path, tiny_dir, demonstrations=False),
        environments={"python_functions": rl_only},
    )
    assert evals == [ids for kind, ids in rl_only.calls if kind == "eval"]
    assert evals and all(set(ids) <= set(heldout_ids) for ids in evals)


def test_demonstrations_lower_their_own_loss(tmp_path, tiny_dir):
    """The ce component really trains on the demonstrations: at a fixed set of three tasks
    (the whole train split), the ce loss falls from step to step."""
    env = PythonFunctionsEnv()
    train_ids, _ = HeldoutSplit(0.25, "composer-replication").split(env.task_ids())
    picked = random.Random(0).sample(train_ids, 3)
    small = PythonFunctionsEnv(tasks=[env.tasks[t] for t in picked] + _heldout_of(env))
    cfg = RunConfig.model_validate(
        {
            "seed": 0,
            "steps": 4,
            "output_dir": str(tmp_path / "sft"),
            "model": {"source": tiny_dir, "lora": {"r": 4, "alpha": 8}},
            "optim": {"lr": 2e-2},
            "eval": {"every": 4, "max_tasks": 1, "samples_per_task": 1, "temperature": 0},
            "envs": [
                {"name": "python_functions", "tasks_per_step": 3, "algorithm": SFT_ON_REFERENCES}
            ],
        }
    )
    result = train(cfg, environments={"python_functions": small})
    losses = [r["loss/ce"] for r in result.metrics if "loss/ce" in r]
    assert len(losses) == 4 and all(b < a for a, b in itertools.pairwise(losses))


def _heldout_of(env: PythonFunctionsEnv) -> list:
    _, heldout = HeldoutSplit(0.25, "composer-replication").split(env.task_ids())
    return [env.tasks[t] for t in heldout[:2]]
