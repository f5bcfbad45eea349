"""Held-out evaluation of a saved model: pass@1 on an environment's held-out tasks."""

from __future__ import annotations

from typing import Any

from composer_replication.envs import build_environment, pass_at_1
from composer_replication.rollout.generate import SamplingSettings
from composer_replication.safety import HeldoutSplit


def heldout_rollouts(
    env: Any,
    policy: Any,
    tokenizer: Any,
    task_ids: list[str],
    *,
    samples_per_task: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
) -> list[list[Any]]:
    """Rollout groups for evaluation, sampled with their own seed.

    The same seed at every evaluation makes before/after comparisons use common random
    numbers; the caller's random streams continue as if nothing had been sampled.
    """
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return env.rollouts(
            policy,
            tokenizer,
            task_ids,
            group_size=samples_per_task,
            sampling=SamplingSettings(max_new_tokens=max_new_tokens, temperature=temperature),
        )


def configured_heldout_rollouts(
    env: Any,
    policy: Any,
    tokenizer: Any,
    heldout_ids: list[str],
    eval_config: Any,
    *,
    max_new_tokens: int,
) -> list[list[Any]]:
    """:func:`heldout_rollouts` as a run's ``EvalConfig`` asks (task cap, samples, seed)."""
    ev = eval_config
    return heldout_rollouts(
        env,
        policy,
        tokenizer,
        heldout_ids[: ev.max_tasks] if ev.max_tasks else list(heldout_ids),
        samples_per_task=ev.samples_per_task,
        temperature=ev.temperature,
        max_new_tokens=max_new_tokens,
        seed=ev.seed,
    )


def evaluate_model(
    model_source: str,
    *,
    env_name: str = "python_functions",
    samples_per_task: int = 4,
    temperature: float = 1.0,
    max_new_tokens: int = 80,
    heldout_fraction: float = 0.25,
    heldout_salt: str = "composer-replication",
    split: str = "heldout",
    env_options: dict[str, Any] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """pass@1 (share of fully solved samples) and mean reward of a model on one split.

    The defaults match the training run's held-out evaluation (``EvalConfig``): 4 samples
    per task at temperature 1, 80 new tokens, sampling seeded with ``seed``.
    """
    from types import SimpleNamespace

    from composer_replication.models import load_policy

    if split not in ("heldout", "train", "all"):
        raise ValueError(f"split={split!r} must be heldout, train or all")
    policy, tokenizer = load_policy(None if model_source == "embedded" else model_source)
    env = build_environment(SimpleNamespace(name=env_name, options=env_options or {}))
    train_ids, heldout_ids = HeldoutSplit(heldout_fraction, heldout_salt).split(env.task_ids())
    ids = {"heldout": heldout_ids, "train": train_ids, "all": env.task_ids()}[split]
    groups = heldout_rollouts(
        env,
        policy,
        tokenizer,
        ids,
        samples_per_task=samples_per_task,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        seed=seed,
    )
    rewards = [r.reward for g in groups for r in g]
    return {
        "model": model_source,
        "env": env_name,
        "split": split,
        "n_tasks": len(ids),
        "samples_per_task": samples_per_task,
        "temperature": temperature,
        "seed": seed,
        "pass@1": pass_at_1(groups),
        "mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
        "per_task": {tid: [r.reward for r in g] for tid, g in zip(ids, groups)},
    }
