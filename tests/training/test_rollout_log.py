"""Rollouts saved as JSONL (``save_rollouts``): which files a run writes and what a row holds.

A real two-step run of the native loop with the tiny model on python_functions (evaluated
at the start and after step 2) writes ``rollouts/eval_step_<step>.jsonl`` and, with
``"all"``, ``rollouts/train_step_<step>.jsonl``; each file holds exactly the rollouts the
environment returned, one row each. ``rollout_rows`` / ``write_rollouts`` are checked on a
hand-made rollout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from composer_replication.config import RunConfig
from composer_replication.envs.python_functions import PythonFunctionsEnv
from composer_replication.inference.decoding.generate import InProcessSampler
from composer_replication.samples.rollout_log import rollout_rows, write_rollouts
from composer_replication.samples.rollouts import Rollout
from composer_replication.training.lifecycle import HeldoutTasks, RunLifecycle
from composer_replication.training.loop import train

ROW_KEYS = {
    "task_id",
    "reward",
    "error",
    "feedback",
    "prompt_tokens",
    "completion_tokens",
    "sampled_tokens",
    "completion",
    "metadata",
}
TRAIN_T, EVAL_T = 0.7, 1.0


class CallRecordingEnv(PythonFunctionsEnv):
    """python_functions keeping every group it returned, in order, with the temperature."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.returned: list[tuple[float, list[list[Rollout]]]] = []

    def rollouts(self, sampler, tokenizer, task_ids, *, group_size, sampling):
        groups = super().rollouts(
            sampler, tokenizer, task_ids, group_size=group_size, sampling=sampling
        )
        self.returned.append((sampling.temperature, groups))
        return groups


def _expected_row(rollout: Rollout, tokenizer) -> dict:
    return {
        "task_id": rollout.task_id,
        "reward": float(rollout.reward),
        "error": rollout.error,
        "feedback": rollout.feedback,
        "prompt_tokens": len(rollout.prompt_ids),
        "completion_tokens": len(rollout.completion_ids),
        "sampled_tokens": sum(rollout.completion_mask),
        "completion": tokenizer.decode(rollout.completion_ids, skip_special_tokens=False),
        "metadata": json.loads(json.dumps(rollout.metadata, default=str)),
    }


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(tmp_path: Path, tiny_dir: str, save: str) -> tuple[Path, CallRecordingEnv, list]:
    cfg = RunConfig.model_validate(
        {
            "seed": 0,
            "steps": 2,
            "output_dir": str(tmp_path / save),
            "model": {"source": tiny_dir, "lora": {"r": 4, "alpha": 8}},
            "optim": {"lr": 1e-2},
            "save_rollouts": save,
            "eval": {"every": 2, "max_tasks": 2, "samples_per_task": 2, "temperature": EVAL_T},
            "envs": [
                {
                    "name": "python_functions",
                    "tasks_per_step": 2,
                    "algorithm": {
                        "sampling": {"group_size": 2, "max_new_tokens": 8, "temperature": TRAIN_T},
                        "advantage": {"type": "grpo"},
                    },
                }
            ],
        }
    )
    env = CallRecordingEnv()
    result = train(cfg, environments={"python_functions": env})
    assert result.steps == 2
    return result.run_dir, env, result.metrics


def test_all_writes_every_evaluation_and_every_training_step(tmp_path, tiny_dir, tokenizer):
    run_dir, env, metrics = _run(tmp_path, tiny_dir, "all")
    files = sorted(p.name for p in (run_dir / "rollouts").iterdir())
    assert files == [
        "eval_step_0000.jsonl",
        "eval_step_0002.jsonl",
        "train_step_0001.jsonl",
        "train_step_0002.jsonl",
    ]
    # the environment's calls: evaluation (sampled, then greedy), two training steps, and
    # the evaluation after step 2
    temperatures = [t for t, _ in env.returned]
    assert temperatures == [EVAL_T, 0.0, TRAIN_T, TRAIN_T, EVAL_T, 0.0]
    flat = [[r for g in groups for r in g] for _, groups in env.returned]
    expected = {
        "eval_step_0000.jsonl": flat[0] + flat[1],  # 2 tasks x 2 samples, then 2 greedy
        "train_step_0001.jsonl": flat[2],  # 2 tasks x group_size 2
        "train_step_0002.jsonl": flat[3],
        "eval_step_0002.jsonl": flat[4] + flat[5],
    }
    counts = {name: len(rollouts) for name, rollouts in expected.items()}
    assert counts == {
        "eval_step_0000.jsonl": 6,
        "train_step_0001.jsonl": 4,
        "train_step_0002.jsonl": 4,
        "eval_step_0002.jsonl": 6,
    }
    for name, rollouts in expected.items():
        rows = _read(run_dir / "rollouts" / name)
        assert [set(row) for row in rows] == [ROW_KEYS] * len(rollouts)
        assert rows == [_expected_row(r, tokenizer) for r in rollouts]
    # a training file holds the step's rollouts/count rollouts, stamped with their version
    by_step = {r["step"]: r for r in metrics if "rollouts/count" in r}
    for step in (1, 2):
        rows = _read(run_dir / "rollouts" / f"train_step_{step:04d}.jsonl")
        assert len(rows) == by_step[step]["rollouts/count"] == 4
        assert {row["metadata"]["policy_version"] for row in rows} == {step - 1}
    # the tiny model writes no working function
    assert {row["reward"] for name in expected for row in _read(run_dir / "rollouts" / name)} == {
        0.0
    }


def test_eval_writes_only_the_evaluations(tmp_path, tiny_dir, tokenizer):
    run_dir, env, _ = _run(tmp_path, tiny_dir, "eval")
    assert sorted(p.name for p in (run_dir / "rollouts").iterdir()) == [
        "eval_step_0000.jsonl",
        "eval_step_0002.jsonl",
    ]
    flat = [[r for g in groups for r in g] for _, groups in env.returned]
    assert _read(run_dir / "rollouts" / "eval_step_0002.jsonl") == [
        _expected_row(r, tokenizer) for r in flat[4] + flat[5]
    ]


def test_none_writes_no_rollouts(tmp_path, tiny_dir):
    run_dir, env, _ = _run(tmp_path, tiny_dir, "none")
    assert len(env.returned) == 6  # it did sample and evaluate
    assert not (run_dir / "rollouts").exists()
    assert (run_dir / "metrics.jsonl").is_file()


def test_eval_is_the_default():
    assert RunConfig.default().save_rollouts == "eval"
    assert RunConfig.default(["save_rollouts=all"]).save_rollouts == "all"
    with pytest.raises(ValueError, match="'none', 'eval' or 'all'"):
        RunConfig.model_validate({"save_rollouts": "train"})


# ------------------------------------------------------------------ the lifecycle


def _lifecycle(tmp_path: Path, save: str, **eval_config) -> RunLifecycle:
    cfg = RunConfig.model_validate(
        {"output_dir": str(tmp_path / save), "save_rollouts": save, "eval": eval_config}
    )
    return RunLifecycle(cfg, backend="native")


def test_the_lifecycle_saves_what_its_setting_asks_for(tmp_path, tokenizer):
    rollout = _hand_made(tokenizer)
    for save, kinds in (("none", ()), ("eval", ("eval",)), ("all", ("eval", "train"))):
        life = _lifecycle(tmp_path, save)
        for kind in ("eval", "train"):
            life.save_rollouts(kind, 7, [[rollout], [rollout]], tokenizer)
            path = life.run_dir / "rollouts" / f"{kind}_step_0007.jsonl"
            assert path.is_file() == (kind in kinds), (save, kind)
            if kind in kinds:
                assert len(_read(path)) == 2


def test_evaluate_saves_only_with_a_step(tmp_path, tiny, tokenizer):
    model, _ = tiny
    env = PythonFunctionsEnv()
    tasks = [HeldoutTasks(env, env.task_ids()[:2], 8)]
    life = _lifecycle(tmp_path, "eval", samples_per_task=1, greedy=False)
    life.evaluate(InProcessSampler(model), tokenizer, tasks)
    assert not (life.run_dir / "rollouts").exists()
    life.evaluate(InProcessSampler(model), tokenizer, tasks, step=3)
    rows = _read(life.run_dir / "rollouts" / "eval_step_0003.jsonl")
    assert [row["task_id"] for row in rows] == env.task_ids()[:2]


def test_a_greedy_evaluation_writes_each_rollout_once(tmp_path, tiny, tokenizer):
    model, _ = tiny
    env = PythonFunctionsEnv()
    tasks = [HeldoutTasks(env, env.task_ids()[:2], 8)]
    life = _lifecycle(tmp_path, "eval", samples_per_task=1, temperature=0)  # greedy on
    life.evaluate(InProcessSampler(model), tokenizer, tasks, step=1)
    rows = _read(life.run_dir / "rollouts" / "eval_step_0001.jsonl")
    assert [row["task_id"] for row in rows] == env.task_ids()[:2]


# ------------------------------------------------------------------ rows


def _hand_made(tokenizer) -> Rollout:
    completion = [*tokenizer("def f():\n    return 1", add_special_tokens=False)["input_ids"]]
    completion.append(tokenizer.eos_token_id)
    observation = [*tokenizer("ok", add_special_tokens=False)["input_ids"]]
    ids = completion + observation
    return Rollout(
        task_id="pf-001",
        prompt_ids=[1, 2, 3],
        completion_ids=ids,
        inference_logprobs=[-0.5] * len(ids),
        completion_mask=[1] * len(completion) + [0] * len(observation),
        reward=0.5,
        feedback="1 of 2 tests failed",
        error=None,
        metadata={
            "end_reason": "answer",
            "events": [{"turn": 1, "type": "answer"}],
            "workdir": Path("/tmp/x"),
            "pair": (1, 2),
        },
    )


def test_rollout_rows_of_a_hand_made_rollout(tokenizer):
    rollout = _hand_made(tokenizer)
    n_completion = len(rollout.completion_ids)
    n_sampled = sum(rollout.completion_mask)
    (row,) = rollout_rows([rollout], tokenizer)
    assert row == {
        "task_id": "pf-001",
        "reward": 0.5,
        "error": None,
        "feedback": "1 of 2 tests failed",
        "prompt_tokens": 3,
        "completion_tokens": n_completion,
        "sampled_tokens": n_sampled,
        "completion": "def f():\n    return 1<|im_end|>ok",
        "metadata": rollout.metadata,
    }
    assert n_sampled < n_completion
    assert isinstance(row["reward"], float)
    (undecoded,) = rollout_rows([rollout], None)
    assert undecoded["completion"] is None
    assert rollout_rows([], tokenizer) == []


def test_write_rollouts_writes_sorted_json_lines(tmp_path, tokenizer):
    rollout = _hand_made(tokenizer)
    other = Rollout("pf-002", [5], [6, 7], [-0.1, -0.2], reward=1.0, error="timeout")
    path = tmp_path / "deep" / "er" / "rollouts.jsonl"
    write_rollouts(path, [rollout, other], tokenizer)
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert list(first) == sorted(ROW_KEYS)  # keys sorted
    # what JSON cannot hold becomes its text; tuples become lists
    assert first["metadata"] == {
        "end_reason": "answer",
        "events": [{"turn": 1, "type": "answer"}],
        "workdir": "/tmp/x",
        "pair": [1, 2],
    }
    second = json.loads(lines[1])
    assert (second["task_id"], second["reward"], second["error"]) == ("pf-002", 1.0, "timeout")
    assert (second["prompt_tokens"], second["completion_tokens"], second["sampled_tokens"]) == (
        1,
        2,
        2,
    )
    assert sorted(p.name for p in path.parent.iterdir()) == ["rollouts.jsonl"]  # no temp file
    write_rollouts(path, [other], None)  # replaced, not appended
    assert [json.loads(line)["completion"] for line in path.read_text().splitlines()] == [None]


def test_write_rollouts_returns_the_path_it_wrote(tmp_path, tokenizer):
    path = tmp_path / "r.jsonl"
    assert write_rollouts(path, [_hand_made(tokenizer)], tokenizer) == path
