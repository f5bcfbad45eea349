"""Held-out evaluation of a saved model: pass@1 on an environment's held-out tasks."""

from __future__ import annotations

from typing import Any

from composer_replication.envs import build_environment, pass_at_1
from composer_replication.rollout.generate import SamplingSettings
from composer_replication.safety import HeldoutSplit


def evaluate_model(
    model_source: str,
    *,
    env_name: str = "python_functions",
    samples_per_task: int = 1,
    temperature: float = 0.0,
    max_new_tokens: int = 96,
    heldout_fraction: float = 0.25,
    heldout_salt: str = "composer-replication",
    split: str = "heldout",
    env_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """pass@1 (share of fully solved samples) and mean reward of a model on one split."""
    from types import SimpleNamespace

    from composer_replication.models import load_policy

    if split not in ("heldout", "train", "all"):
        raise ValueError(f"split={split!r} must be heldout, train or all")
    policy, tokenizer = load_policy(None if model_source == "embedded" else model_source)
    env = build_environment(SimpleNamespace(name=env_name, options=env_options or {}))
    train_ids, heldout_ids = HeldoutSplit(heldout_fraction, heldout_salt).split(env.task_ids())
    ids = {"heldout": heldout_ids, "train": train_ids, "all": env.task_ids()}[split]
    groups = env.rollouts(
        policy,
        tokenizer,
        ids,
        group_size=samples_per_task,
        sampling=SamplingSettings(max_new_tokens=max_new_tokens, temperature=temperature),
    )
    rewards = [r.reward for g in groups for r in g]
    return {
        "model": model_source,
        "env": env_name,
        "split": split,
        "n_tasks": len(ids),
        "samples_per_task": samples_per_task,
        "pass@1": pass_at_1(groups),
        "mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
        "per_task": {tid: [r.reward for r in g] for tid, g in zip(ids, groups)},
    }
