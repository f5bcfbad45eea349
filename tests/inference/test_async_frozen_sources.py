"""Sampling ahead (``async_level = 1``) with frozen sources beside the live policy: one real
run with three environments, grpo (the live policy, sampled by the vLLM engine), opd whose
samples come from a frozen local model, and sft on the reference solutions. A frozen
source's rollouts carry no policy version, are counted every step and never dropped as
stale; the staleness bound, applied to the run's own batches long after they were sampled,
drops the live policy's groups and keeps every frozen one.

Skipped only when the engine's virtualenv is absent (``make vllm-env`` builds it)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from composer_replication.config import RunConfig
from composer_replication.envs.python_functions import PythonFunctionsEnv
from composer_replication.training.loop import Trainer
from composer_replication.training.rollout_queue import drop_stale

sys.path.insert(0, str(Path(__file__).parents[1] / "training"))
from scripted_env import ScriptedEnv

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PYTHON = Path(
    os.environ.get("COMPOSER_REPLICATION_VLLM_PYTHON", ROOT / ".venv-vllm/bin/python")
)
STEPS, TASKS, GROUP = 3, 2, 2

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        not ENGINE_PYTHON.exists(),
        reason=f"the engine's virtualenv is absent ({ENGINE_PYTHON}); build it with `make vllm-env`",
    ),
]


class RecordingEnv(ScriptedEnv):
    """ScriptedEnv under its own name; keeps the groups of every training call."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.ids = [f"{name}-{i:02d}" for i in range(len(self.ids))]
        self.train_calls: list[list[list]] = []

    def rollouts(self, sampler, tokenizer, task_ids, *, group_size, sampling):
        groups = super().rollouts(
            sampler, tokenizer, task_ids, group_size=group_size, sampling=sampling
        )
        if sampling.temperature != 0:
            self.train_calls.append(groups)
        return groups


class RecordingReferences(PythonFunctionsEnv):
    """python_functions that keeps the groups of every call for its demonstrations."""

    def __init__(self):
        super().__init__()
        self.train_calls: list[list[list]] = []

    def demonstrations(self, tokenizer, task_ids, *, group_size):
        groups = super().demonstrations(tokenizer, task_ids, group_size=group_size)
        self.train_calls.append(groups)
        return groups


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Policy, opd source and opd teacher: three tiny Llamas the CPU engine can serve
    (head size 64), with the real tokenizer."""
    from composer_replication.model.loading import load_tokenizer, save_checkpoint, tiny_model

    root = tmp_path_factory.mktemp("models")
    tokenizer = load_tokenizer()
    shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2)
    out = {}
    for name, seed in (("policy", 0), ("source", 1), ("teacher", 2)):
        model = tiny_model(seed=seed, num_key_value_heads=1, **shape)
        out[name] = str(save_checkpoint(model, root / name, tokenizer=tokenizer))
    return out


def _config(tmp_path: Path, models: dict[str, str]) -> RunConfig:
    frozen = 'name = "{name}"\nlocal_path = "{path}"'
    return RunConfig.from_toml(
        textwrap.dedent(
            f"""
            seed = 0
            steps = {STEPS}
            output_dir = "{tmp_path / "run"}"
            [model]
            source = "{models["policy"]}"
            [optim]
            lr = 1e-3
            [eval]
            at_start = false
            every = 100
            max_tasks = 1
            samples_per_task = 1
            temperature = 0
            [guard]
            min_steps = 100
            [checkpoint]
            every = 100
            [inference]
            engine = "vllm"
            python = "{ENGINE_PYTHON}"
            max_model_len = 512
            optimization_level = 0
            startup_timeout_s = 600
            serve_frozen = false
            async_level = 1
            max_off_policy_steps = 1

            [[envs]]
            name = "live"
            tasks_per_step = {TASKS}
            [envs.algorithm.sampling]
            group_size = {GROUP}
            [envs.algorithm.advantage]
            type = "grpo"

            [[envs]]
            name = "distilled"
            tasks_per_step = {TASKS}
            [envs.algorithm.sampling]
            group_size = {GROUP}
            [envs.algorithm.sampling.source]
            {frozen.format(name="source", path=models["source"])}
            [envs.algorithm.advantage]
            type = "opd"
            [envs.algorithm.advantage.model]
            {frozen.format(name="teacher", path=models["teacher"])}

            [[envs]]
            name = "python_functions"
            tasks_per_step = {TASKS}
            [envs.algorithm.sampling]
            source = "reference"
            [envs.algorithm.advantage]
            type = "sft"
            """
        ),
        overrides=["model.lora=null"],
    )


def test_frozen_sources_are_never_dropped_as_stale(tmp_path, models):
    live, distilled, references = (
        RecordingEnv("live"),
        RecordingEnv("distilled"),
        RecordingReferences(),
    )
    trainer = Trainer(
        _config(tmp_path, models),
        environments={"live": live, "distilled": distilled, "python_functions": references},
    )
    assert [rt.sampler.samples_from_live_policy for rt in trainer.runtimes] == [
        True,
        False,
        False,
    ]
    result = trainer.run()
    assert result.steps == STEPS
    rows = [
        json.loads(line)
        for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    frozen_per_step = TASKS * GROUP + TASKS  # opd's frozen samples + one demonstration each
    for row in steps:
        # every frozen-source rollout of the step is counted and kept
        assert row["rollouts/frozen_source"] == frozen_per_step
        assert row["rollouts/stale_dropped"] == 0
        assert row["rollouts/demonstrations"] == TASKS
        assert row["tokens/ref_kl"] > 0 and row["tokens/ce"] > 0  # both were trained on
    # one step sampled ahead of the last: STEPS + 1 batches per environment
    assert len(live.train_calls) == len(distilled.train_calls) == STEPS + 1
    assert len(references.train_calls) == STEPS + 1
    for calls in (distilled.train_calls, references.train_calls):
        for r in (r for groups in calls for g in groups for r in g):
            assert r.from_frozen_source and r.policy_version is None
    versions = [{r.policy_version for g in groups for r in g} for groups in live.train_calls]
    assert versions == [{0}, {0}, {1}, {2}]  # the live policy's batches, one version each

    # The bound on the run's last batch, as if trained much later: the live policy's groups
    # are too old, the frozen sources' are not (they have no age).
    batch = [live.train_calls[-1], distilled.train_calls[-1], references.train_calls[-1]]
    tasks = [[g[0].task_id for g in groups] for groups in batch]
    kept_tasks, _, metrics = drop_stale(
        tasks, batch, trainer_version=STEPS + 10, max_off_policy_steps=1
    )
    assert kept_tasks == [[], tasks[1], tasks[2]]
    assert metrics["rollouts/stale_dropped"] == TASKS * GROUP
    assert metrics["rollouts/frozen_source"] == frozen_per_step
