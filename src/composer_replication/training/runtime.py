"""Typed runtime records of a run: each environment with its algorithm, task split,
curriculum and sampler (its rollout source), built from the run config.

The loop only ever sees these records; it never looks at an algorithm's name. What an
algorithm needs (pairs, scorers, the live policy as its own reference) it takes in its own
``build`` step from :class:`~composer_replication.algo.base.AlgorithmResources`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from composer_replication.rollout.env_sampler import EnvSampler

if TYPE_CHECKING:
    from composer_replication.algo.base import Algorithm
    from composer_replication.config.run import EnvConfig
    from composer_replication.envs.base import Environment
    from composer_replication.envs.curriculum import DifficultyCurriculum
    from composer_replication.safety.holdout import HeldoutSplit
    from composer_replication.samples.generation import SamplingSettings


@dataclass
class EnvRuntime:
    """One environment of a run, ready to sample from.

    Attributes:
        config: the ``[[envs]]`` entry it was built from.
        env: the environment (tasks, rollouts, grading).
        algorithm: turns its rollout groups into training samples.
        train_ids / heldout_ids: its task split (held-out tasks are never trained on).
        sampler: its rollout source (the live policy or a frozen pool), whether that is
            live, and the sampling arguments (:class:`~composer_replication.rollout.
            env_sampler.EnvSampler`).
        curriculum: picks the train tasks of each step.
    """

    config: EnvConfig
    env: Environment
    algorithm: Algorithm
    train_ids: list[str]
    heldout_ids: list[str]
    sampler: EnvSampler
    curriculum: DifficultyCurriculum

    @property
    def sampling(self) -> SamplingSettings:
        """Generation settings of its rollouts."""
        return self.sampler.settings

    @property
    def group_size(self) -> int:
        """Rollouts per task."""
        return self.sampler.group_size

    @property
    def evaluation_key(self) -> tuple[str, str]:
        """Entries with the same environment and options share their held-out tasks."""
        import json

        return self.config.name, json.dumps(self.config.options, sort_keys=True, default=str)


def build_runtime(
    env_config: EnvConfig,
    *,
    policy: Any,
    tokenizer: Any,
    split: HeldoutSplit,
    seed: int,
    env: Environment | None = None,
    say: Callable[[str], None] | None = None,
) -> EnvRuntime:
    """The runtime of one ``[[envs]]`` entry (``env`` overrides building it by name). An
    entry naming a repository (``options.repo``) gets that repository's tasks, generated on
    first use (``datagen.repository_tasks``; ``say`` hears its progress)."""
    from composer_replication.algo import build_algorithm
    from composer_replication.config.references import REFERENCE_SOLUTIONS
    from composer_replication.datagen.repository_tasks import resolve_repository_options
    from composer_replication.envs import DemonstratingEnvironment, build_environment
    from composer_replication.envs.curriculum import DifficultyCurriculum

    if env is None:
        options = resolve_repository_options(
            env_config.name,
            env_config.options,
            max_new_tokens=env_config.algorithm.sampling.max_new_tokens,
            split=split,
            tokenizer=tokenizer,
            say=say,
        )
        env = build_environment(env_config.model_copy(update={"options": options}))
    recorded = getattr(env, "recorded_split", None)
    if recorded is not None:  # tasks made with a split of their own: it must be ours
        from composer_replication.safety.holdout import check_same_split

        check_same_split(recorded, split, f"the tasks of environment {env.name!r}")
    algo_cfg = env_config.algorithm
    sampling = algo_cfg.sampling
    if sampling.source == REFERENCE_SOLUTIONS and not isinstance(env, DemonstratingEnvironment):
        raise ValueError(
            f"environment {env.name!r} gives no reference solutions (it has no "
            "demonstrations method), so sampling.source = 'reference' has nothing to train "
            "on: use an environment that does (python_functions, feature_deletion), or a frozen model as source"
        )
    algorithm = build_algorithm(
        algo_cfg, tokenizer=tokenizer, policy=policy, rng=random.Random(seed)
    )
    train_ids, heldout_ids = split.split(env.task_ids())
    if not train_ids or not heldout_ids:
        from composer_replication.common.errors import UsageError

        raise UsageError(
            f"environment {env.name!r}: the split left {len(train_ids)} train and "
            f"{len(heldout_ids)} held-out tasks; change heldout_fraction or add tasks"
        )
    if env_config.tasks_per_step > len(train_ids):
        from composer_replication.common.errors import UsageError

        raise UsageError(
            f"tasks_per_step = {env_config.tasks_per_step} of environment {env.name!r} is more "
            f"than its {len(train_ids)} training tasks; set it to at most {len(train_ids)}"
        )
    return EnvRuntime(
        config=env_config,
        env=env,
        algorithm=algorithm,
        train_ids=train_ids,
        heldout_ids=heldout_ids,
        sampler=EnvSampler.from_config(sampling),
        curriculum=DifficultyCurriculum(train_ids, split=split),
    )
