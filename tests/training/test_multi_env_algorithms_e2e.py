"""One real ``train`` run with four environments, each under its own algorithm: grpo (rl),
opd against a frozen local teacher (ref_kl), sft from a frozen local source (ce), echo with
a filter (rl on actions + ce on tool observations). From ``metrics.jsonl``: every component
counts exactly the tokens its environments' algorithms routed to it, every loss is finite
and sums into the objective, the ref_kl trust-region metrics are logged, and the weights
moved. Native backend, tiny random model, 2 steps."""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from composer_replication.config import RunConfig
from composer_replication.model.loading import load_checkpoint, save_checkpoint, tiny_policy
from composer_replication.training.loop import train

sys.path.insert(0, str(Path(__file__).parent))
from scripted_env import ScriptedEnv

OBSERVATION = "tool output: 2 passed"


class RecordingEnv(ScriptedEnv):
    """ScriptedEnv with its own task ids that keeps the rollouts of every training call."""

    def __init__(self, name: str, **kwargs):
        super().__init__(**kwargs)
        self.name = name
        self.ids = [f"{name}-{i:02d}" for i in range(len(self.ids))]
        self.train_rollouts: list[list] = []  # per training call (one call per step)

    def rollouts(self, policy, tokenizer, task_ids, *, group_size, sampling):
        groups = [self.finish(g, tokenizer) for g in super().rollouts(
            policy, tokenizer, task_ids, group_size=group_size, sampling=sampling
        )]  # fmt: skip
        if sampling.temperature != 0:
            self.train_rollouts.append([r for g in groups for r in g])
        return groups

    def finish(self, group, tokenizer):
        return group


class ToolTurnEnv(RecordingEnv):
    """Each attempt is one sampled turn followed by a tool observation, with roles."""

    def finish(self, group, tokenizer):
        obs = tokenizer(OBSERVATION, add_special_tokens=False)["input_ids"]
        for r in group:
            n = len(r.completion_ids)
            r.completion_ids = [*r.completion_ids, *obs]
            r.inference_logprobs = [*r.inference_logprobs, *[0.0] * len(obs)]
            r.completion_mask = [1] * n + [0] * len(obs)
            r.token_roles = ["assistant"] * n + ["tool"] * len(obs)
        return group


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Policy, opd teacher and sft source: three different tiny random models on disk."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, seed in (("policy", 0), ("teacher", 1), ("source", 2)):
        model, tok = tiny_policy(seed=seed)
        out[name] = str(save_checkpoint(model, root / name, tokenizer=tok))
    return out


def _config(tmp_path: Path, models: dict[str, str]) -> RunConfig:
    frozen = 'name = "{name}"\nlocal_path = "{path}"'
    return RunConfig.from_toml(
        textwrap.dedent(
            f"""
            seed = 0
            steps = 2
            output_dir = "{tmp_path / "run"}"
            micro_batch_tokens = 256
            [model]
            source = "{models["policy"]}"
            [model.lora]
            r = 4
            alpha = 8
            [optim]
            lr = 1e-2
            [eval]
            at_start = false
            max_tasks = 1
            samples_per_task = 1
            temperature = 0
            [guard]
            min_steps = 100

            [[envs]]
            name = "env_rl"
            tasks_per_step = 2
            [envs.algorithm.sampling]
            group_size = 2
            [envs.algorithm.advantage]
            type = "grpo"

            [[envs]]
            name = "env_distill"
            tasks_per_step = 2
            [envs.algorithm.sampling]
            group_size = 2
            [envs.algorithm.advantage]
            type = "opd"
            [envs.algorithm.advantage.model]
            {frozen.format(name="teacher", path=models["teacher"])}

            [[envs]]
            name = "env_imitate"
            tasks_per_step = 2
            [envs.algorithm.sampling]
            group_size = 2
            [envs.algorithm.sampling.source]
            {frozen.format(name="source", path=models["source"])}
            [envs.algorithm.advantage]
            type = "sft"

            [[envs]]
            name = "env_tools"
            tasks_per_step = 2
            [envs.algorithm.sampling]
            group_size = 2
            [envs.algorithm.advantage]
            type = "echo"
            [envs.algorithm.advantage.filter]
            import_path = "e2e_echo_filter:rewarded"
            [envs.algorithm.advantage.filter.kwargs]
            min_reward = 0.05
            """
        )
    )


def _state(path: str) -> dict[str, torch.Tensor]:
    model, _ = load_checkpoint(path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_four_environments_four_algorithms_one_run(tmp_path, models, monkeypatch):
    (tmp_path / "e2e_echo_filter.py").write_text(
        "def rewarded(rollout, *, min_reward):\n"
        "    return [[rollout.reward >= min_reward] * len(s) for s in rollout.trajectory]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    envs = {
        "env_rl": RecordingEnv("env_rl"),
        "env_distill": RecordingEnv("env_distill"),
        "env_imitate": RecordingEnv("env_imitate"),
        "env_tools": ToolTurnEnv("env_tools"),
    }
    result = train(_config(tmp_path, models), environments=envs)
    assert result.steps == 2

    rows = [
        json.loads(line)
        for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for env in envs.values():
        assert len(env.train_rollouts) == 2  # one training call per step

    def sampled(env, step):
        return sum(sum(r.completion_mask) for r in env.train_rollouts[step])

    for i, row in enumerate(steps):
        tools = envs["env_tools"].train_rollouts[i]
        kept = [r for r in tools if r.reward >= 0.05]
        assert 0 < len(kept) < len(tools)  # the filter really drops some observations
        observed = sum(len(r.completion_ids) - sum(r.completion_mask) for r in kept)
        # every environment's tokens land in its algorithm's component, and only there
        assert row["tokens/rl"] == sampled(envs["env_rl"], i) + sampled(envs["env_tools"], i)
        assert row["tokens/ref_kl"] == sampled(envs["env_distill"], i)
        assert row["tokens/ce"] == sampled(envs["env_imitate"], i) + observed
        assert row["tokens/jsd"] == 0 and row["tokens/dpo"] == 0
        assert min(row["tokens/rl"], row["tokens/ref_kl"], row["tokens/ce"]) > 0
        # each component's loss is finite; ce (an NLL) and ref_kl (different teacher) are
        # non-zero, and the objective is their sum (coefficients 1)
        for name in ("rl", "ce", "ref_kl"):
            assert math.isfinite(row[f"loss/{name}"]), name
        assert row["loss/ce"] > 0
        assert row["loss/ref_kl"] != 0
        assert row["loss"] == pytest.approx(
            row["loss/rl"] + row["loss/ce"] + row["loss/ref_kl"], rel=1e-5, abs=1e-6
        )
        assert row["loss/jsd"] == 0 and row["loss/dpo"] == 0
        # the ref_kl trust-region metrics are logged when ref_kl is active
        assert 0.0 <= row["ref_kl/is_masked/mean"] <= 1.0
        for key in ("ref_kl/mean", "ref_kl/masked_mismatch_kl/mean"):
            assert math.isfinite(row[key]), key
        assert row["ref_kl/unmasked_mismatch_kl/mean"] >= 0
        assert row["grad_norm"] > 0 and math.isfinite(row["grad_norm"])

    before, after = _state(models["policy"]), _state(str(result.final_model_dir))
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed, "training left every parameter unchanged"
