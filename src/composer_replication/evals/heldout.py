"""Held-out evaluation: greedy pass@1, sampled pass@1 and pass@k on an environment's
held-out tasks (the ``eval --suite heldout`` command and the training run's evaluations).

An attempt counts as solved when its reward is 1.0 (every test of the task passes);
attempts whose sandbox never ran (``infrastructure_error``) are left out. Sampled pass@1 is
the share of solved attempts; pass@k uses the unbiased estimator of arXiv 2107.03374
(:mod:`composer_replication.evals.pass_at_k`) per task; greedy pass@1 is the share of tasks
whose temperature-0 answer is solved. Sampling is seeded inside a forked RNG, so every
evaluation of a run (and two models evaluated with the same seed) draws with common random
numbers. HumanEval is in :mod:`composer_replication.evals.humaneval`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_replication.envs import build_environment, pass_at_1
from composer_replication.safety import HeldoutSplit
from composer_replication.samples.generation import SamplingSettings

if TYPE_CHECKING:
    from composer_replication.roles import Sampler


def heldout_rollouts(
    env: Any,
    sampler: Sampler,
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
    numbers: each answer's random numbers depend on ``seed``, its prompt and its place in
    the group only (not on the step, the run's seed or the batch), so a run's evaluations
    and ``composer-replication eval`` with the same seed draw alike. The caller's random
    streams continue as if nothing had been sampled.
    """
    import torch

    from composer_replication.inference.decoding.generate import derived_seed, seeded_rows

    with torch.random.fork_rng(devices=[]), seeded_rows(derived_seed(int(seed), "heldout")):
        torch.manual_seed(seed)
        return env.rollouts(
            sampler,
            tokenizer,
            task_ids,
            group_size=samples_per_task,
            sampling=SamplingSettings(max_new_tokens=max_new_tokens, temperature=temperature),
        )


def evaluation_rollouts(
    env: Any,
    sampler: Sampler,
    tokenizer: Any,
    task_ids: list[str],
    *,
    samples_per_task: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    greedy: bool,
) -> tuple[list[list[Any]], list[list[Any]] | None]:
    """The sampled groups of :func:`heldout_rollouts` and, with ``greedy``, one greedy
    (temperature 0) answer per task (the samples' first answers when ``temperature`` is 0).

    Both sample the same prompts, which are prefilled once
    (:func:`~composer_replication.inference.decoding.generate.reuse_prompt_states`): the policy does not
    change in between.
    """
    from composer_replication.inference.decoding.generate import reuse_prompt_states

    settings = dict(max_new_tokens=max_new_tokens, seed=seed)
    with reuse_prompt_states():
        groups = heldout_rollouts(
            env,
            sampler,
            tokenizer,
            task_ids,
            samples_per_task=samples_per_task,
            temperature=temperature,
            **settings,
        )
        if not greedy:
            return groups, None
        if temperature == 0:
            return groups, [g[:1] for g in groups]
        greedy_groups = heldout_rollouts(
            env, sampler, tokenizer, task_ids, samples_per_task=1, temperature=0.0, **settings
        )
    return groups, greedy_groups


def configured_evaluation_rollouts(
    env: Any,
    sampler: Sampler,
    tokenizer: Any,
    heldout_ids: list[str],
    eval_config: Any,
    *,
    max_new_tokens: int,
) -> tuple[list[list[Any]], list[list[Any]] | None]:
    """:func:`evaluation_rollouts` as a run's ``EvalConfig`` asks (task cap, samples,
    temperature, seed, greedy)."""
    ev = eval_config
    return evaluation_rollouts(
        env,
        sampler,
        tokenizer,
        heldout_ids[: ev.max_tasks] if ev.max_tasks else list(heldout_ids),
        samples_per_task=ev.samples_per_task,
        temperature=ev.temperature,
        max_new_tokens=max_new_tokens,
        seed=ev.seed,
        greedy=ev.greedy,
    )


def evaluated(
    groups: Sequence[Sequence[Any]], greedy_groups: Sequence[Sequence[Any]] | None
) -> list[list[Any]]:
    """Every rollout an evaluation sampled, once each: the sampled groups, then the greedy
    answers that are not among them (at temperature 0 they are the samples' first), marked
    ``metadata["greedy"]``."""
    seen = {id(r) for group in groups for r in group}
    greedy = [[r for r in group if id(r) not in seen] for group in greedy_groups or ()]
    for group in greedy:
        for rollout in group:
            rollout.metadata["greedy"] = True
    return [list(g) for g in groups] + [g for g in greedy if g]


def success_counts(groups: Sequence[Sequence[Any]]) -> list[tuple[int, int]]:
    """``(attempts, solved)`` per group: reward 1.0 is solved, attempts whose sandbox never
    ran are not counted."""
    counts = []
    for group in groups:
        attempts = [r for r in group if not r.infrastructure_error]
        counts.append((len(attempts), sum(1 for r in attempts if r.reward >= 1.0)))
    return counts


def groups_pass_at_k(groups: Sequence[Sequence[Any]], ks: Sequence[int]) -> dict[int, float]:
    """k -> mean unbiased pass@k over the groups (arXiv 2107.03374); a k no group has
    enough attempts for is left out."""
    from composer_replication.evals.pass_at_k import mean_pass_at_k

    counts = success_counts(groups)
    found = {k: mean_pass_at_k(counts, k) for k in ks}
    return {k: v for k, v in found.items() if v is not None}


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
    greedy: bool = True,
    limit: int | None = None,
    device: str = "auto",
    rollouts_path: str | os.PathLike[str] | None = None,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Sampled pass@1 and pass@k, greedy pass@1 and mean reward of a model on one split.

    The model is loaded onto ``device`` (``"auto"``: a GPU when one is visible).

    The sampling defaults match the training run's held-out evaluation (``EvalConfig``): 4
    samples per task at temperature 1, 80 new tokens, seeded with ``seed``. ``greedy``
    adds one temperature-0 answer per task (reused from the samples when ``temperature``
    is 0); ``limit`` keeps the split's first ``limit`` tasks.

    Repository tasks (``env_name="feature_deletion"``) come from ``env_options``: a
    ``task_file``, or a ``repo`` whose tasks are made on first use
    (``datagen.repository_tasks``; ``say`` hears its progress); ``max_new_tokens`` is then
    the budget of one turn. ``rollouts_path``: every evaluated rollout written there as
    JSONL.

    Keys: ``suite`` ("heldout"), ``model``, ``env``, ``split``, ``n_tasks``,
    ``samples_per_task``, ``temperature``, ``seed``, ``pass@1`` (share of solved samples),
    ``pass@k`` for the other k of ``reported_ks(samples_per_task)``, ``greedy_pass@1``
    (None without ``greedy``), ``mean_reward``, ``per_task`` (task id -> sampled rewards),
    ``greedy_per_task`` (task id -> greedy reward, with ``greedy``) and, for agent
    episodes, ``agent`` (``episode_metrics`` of the sampled episodes).
    """
    from types import SimpleNamespace

    from composer_replication.evals.pass_at_k import reported_ks
    from composer_replication.inference.decoding.generate import InProcessSampler
    from composer_replication.model.loading import load_policy

    if split not in ("heldout", "train", "all"):
        raise ValueError(f"split={split!r} must be heldout, train or all")
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit} must be >= 1 (or None for every task of the split)")
    from composer_replication.model.devices import resolve_device

    policy, tokenizer = load_policy(
        None if model_source == "embedded" else model_source, device=resolve_device(device)
    )
    from composer_replication.datagen.repository_tasks import resolve_repository_options

    splitter = HeldoutSplit(heldout_fraction, heldout_salt)
    options = resolve_repository_options(
        env_name,
        env_options or {},
        max_new_tokens=max_new_tokens,
        split=splitter,
        tokenizer=tokenizer,
        say=say,
    )
    env = build_environment(SimpleNamespace(name=env_name, options=options))
    train_ids, heldout_ids = splitter.split(env.task_ids())
    ids = {"heldout": heldout_ids, "train": train_ids, "all": env.task_ids()}[split]
    ids = ids[:limit] if limit is not None else ids
    from composer_replication.model.cpu_allocator import TRIM_EVERY_S, trimming_heap
    from composer_replication.model.devices import module_device

    on_cpu = module_device(policy).type == "cpu"
    with trimming_heap(TRIM_EVERY_S if on_cpu else None):  # an agent's kept states: see there
        groups, greedy_groups = evaluation_rollouts(
            env,
            InProcessSampler(policy),
            tokenizer,
            ids,
            samples_per_task=samples_per_task,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            seed=seed,
            greedy=greedy,
        )
    rewards = [r.reward for g in groups for r in g]
    more_ks = [k for k in reported_ks(samples_per_task) if k > 1]
    result: dict[str, Any] = {
        "suite": "heldout",
        "model": model_source,
        "env": env_name,
        "split": split,
        "n_tasks": len(ids),
        "samples_per_task": samples_per_task,
        "temperature": temperature,
        "seed": seed,
        "pass@1": pass_at_1(groups),
        **{f"pass@{k}": v for k, v in groups_pass_at_k(groups, more_ks).items()},
        "greedy_pass@1": None if greedy_groups is None else pass_at_1(greedy_groups),
        "mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
        "per_task": {tid: [r.reward for r in g] for tid, g in zip(ids, groups)},
    }
    if greedy_groups is not None:
        result["greedy_per_task"] = {tid: g[0].reward for tid, g in zip(ids, greedy_groups)}
    from composer_replication.rollout.agent import episode_metrics

    agent = episode_metrics([r for g in groups for r in g])
    if agent:
        result["agent"] = agent
    if rollouts_path is not None:
        from composer_replication.samples.rollout_log import write_rollouts

        every = evaluated(groups, greedy_groups)
        write_rollouts(Path(rollouts_path), [r for g in every for r in g], tokenizer)
    return result
