"""The four roles of a run as Monarch actors, built from the native loop's own parts.

- :class:`GeneratorActor` (Sampler): a policy copy that takes version-tagged weights from
  the learner and samples its share of a step's tasks. A single-turn environment (a
  :class:`~composer_replication.envs.base.SplitEnvironment`, e.g. ``python_functions``) is
  only sampled here and graded by a rewarder; a multi-turn environment (``feature_deletion``:
  sampling and tool calls interleave) runs whole episodes here, tools in this process's
  sandbox, graded on the spot.
- :class:`RewarderActor` (Grader): grades sampled completions through the environments and
  their sandboxes (each split environment is a :class:`~composer_replication.roles.Grader`).
- :class:`TrainerActor` (Learner): a :class:`~composer_replication.training.learner.Learner`
  (the algorithm-blind step, AdamW, schedule, teachers) whose methods of the
  :class:`~composer_replication.roles.Learner` role the controller calls through one
  endpoint (:meth:`TrainerActor.call_learner`); it publishes its trainable weights with a version
  after every step, and writes the run's checkpoints.
- :class:`TeacherPoolActor` (Teachers): teacher replay of trace states through teacher
  endpoints (:func:`~composer_replication.traces.teacher_replay.replay.replay_trace`).

Every actor builds its parts from the same :class:`~composer_replication.config.run.
RunConfig` as the native loop (``setup_policy``, ``build_runtime``, ``Learner``), so a
process holds exactly what the in-process run would.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from composer_replication.envs.base import SplitEnvironment
from composer_replication.inference.decoding.generate import DecodeOptions, InProcessSampler
from composer_replication.roles import Learner, protocol_methods
from composer_replication.samples.rollouts import stamp_policy_version
from composer_replication.training.checkpoint import trainable_state
from monarch.actor import Actor, endpoint

if TYPE_CHECKING:
    from composer_replication.config.run import RunConfig
    from composer_replication.samples.rollouts import Rollout
    from composer_replication.training.runtime import EnvRuntime

#: the methods of the Learner role the trainer process answers for the controller
LEARNER_METHODS = protocol_methods(Learner)

__all__ = [
    "LEARNER_METHODS",
    "GeneratorActor",
    "RewarderActor",
    "TeacherPoolActor",
    "TrainerActor",
    "is_split_environment",
    "shard_seed",
    "trainable_state",
]


def is_split_environment(env: Any) -> bool:
    """True when ``env`` samples and grades in separate calls (a
    :class:`~composer_replication.envs.base.SplitEnvironment`); such an environment is
    sampled by generators and graded by rewarders."""
    return isinstance(env, SplitEnvironment)


def shard_seed(seed: int, step: int, env_index: int, shard: int) -> int:
    """The torch seed of one generator's sampling call: fixed by (run seed, step,
    environment, shard), so a run's rollouts do not depend on process scheduling."""
    digest = hashlib.sha256(f"{seed}/{step}/{env_index}/{shard}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def load_trainable_state(policy: Any, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (from :func:`trainable_state`) into ``policy``; names must match."""
    params = dict(policy.named_parameters())
    unknown = sorted(set(state) - set(params))
    if unknown:
        raise ValueError(f"weights for unknown parameters {unknown[:3]}: not this policy's")
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)


def _policy_runtimes(config: RunConfig) -> tuple[Any, Any, list[EnvRuntime]]:
    """The policy, tokenizer and environment runtimes exactly as the native loop builds them."""
    from composer_replication.safety import HeldoutSplit
    from composer_replication.training.runtime import build_runtime
    from composer_replication.training.setup import seed_everything, setup_policy

    seed_everything(config.seed)
    policy, tokenizer = setup_policy(config.model)
    split = HeldoutSplit(heldout_fraction=config.heldout_fraction, salt=config.heldout_salt)
    runtimes = [
        build_runtime(env_cfg, policy=policy, tokenizer=tokenizer, split=split, seed=config.seed)
        for env_cfg in config.envs
    ]
    return policy, tokenizer, runtimes


class GeneratorActor(Actor):
    """Sampler: samples rollouts of its share of a step's tasks with the newest weights,
    with the decode options it is built with (the run's ``[inference]`` settings)."""

    def __init__(self, config: RunConfig, decode: DecodeOptions | None = None) -> None:
        self.config = config
        self.policy, self.tokenizer, self.runtimes = _policy_runtimes(config)
        self.policy.eval()
        self.sampler = InProcessSampler(self.policy, decode=decode)
        self.version = 0  # the initial weights are version 0 everywhere

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> int:
        """Take the learner's weights of ``version``; returns the version now held."""
        if version < self.version:
            raise ValueError(f"weights of version {version} are older than held {self.version}")
        load_trainable_state(self.policy, state)
        self.version = version
        return self.version

    @endpoint
    def sample(
        self, env_index: int, task_ids: list[str], step: int, shard: int
    ) -> list[list[Rollout]]:
        """One group per task id, from the environment's sampler (this generator's policy
        copy, or its frozen source): sampled only (split environments) or whole episodes
        (multi-turn ones). Each rollout of the policy records ``metadata["policy_version"]``
        (a frozen source's none)."""
        rt = self.runtimes[env_index]
        if not task_ids:
            return []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(shard_seed(self.config.seed, step, env_index, shard))
            groups = rt.sampler.rollouts(
                rt.env,
                self.sampler,
                self.tokenizer,
                task_ids,
                graded=not is_split_environment(rt.env),
            )
        for group in groups:
            stamp_policy_version(group, self.version)
        return groups

    @endpoint
    def decode_loops(self) -> dict[str, int]:
        """How many sampling calls each decode loop ran here ('static' / 'general')."""
        return dict(self.sampler.decode_loops)

    @endpoint
    def completion_logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        """Log-probs of ``completion_ids`` after ``prompt_ids`` under the held weights."""
        return completion_logprobs(self.policy, prompt_ids, completion_ids)


def completion_logprobs(
    policy: Any, prompt_ids: Sequence[int], completion_ids: Sequence[int]
) -> list[float]:
    """Per-token log-probs (temperature 1) of a completion given its prompt."""
    from composer_replication.model.parts import last_hidden_states, lm_head_weight
    from composer_replication.ops.head import token_logprobs_from_hidden

    ids = torch.tensor([list(prompt_ids) + list(completion_ids)], dtype=torch.long)
    with torch.no_grad():
        hidden = last_hidden_states(policy, ids, torch.ones_like(ids))[0, :-1]
        logprobs = token_logprobs_from_hidden(hidden, lm_head_weight(policy), ids[0, 1:])
    return [float(x) for x in logprobs[len(prompt_ids) - 1 :]]


class RewarderActor(Actor):
    """Grader: grades sampled completions of split environments in their sandboxes."""

    def __init__(self, config: RunConfig) -> None:
        from composer_replication.envs import build_environment

        self.envs = [build_environment(env_cfg) for env_cfg in config.envs]

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def grade(self, env_index: int, groups: list[list[Rollout]]) -> list[list[Rollout]]:
        """The groups with rewards, feedback and errors filled in (never raises for a bad
        completion: that is a graded failure)."""
        env = self.envs[env_index]
        if not isinstance(env, SplitEnvironment):
            raise ValueError(f"environment {env.name!r} grades inside its episodes, not here")
        return env.grade_groups(groups)


class TrainerActor(Actor):
    """Learner: the algorithm-blind step, optimizer and schedule; publishes weights.

    ``version`` is the step number of the last :meth:`call_learner` ``update`` (0: the initial
    weights, or the checkpoint's step after :meth:`resume`)."""

    def __init__(self, config: RunConfig, run_dir: str) -> None:
        from composer_replication.distributed.data_parallel import autocast_for
        from composer_replication.distributed.ranks import RankGroup
        from composer_replication.training.checkpoint import CheckpointManager
        from composer_replication.training.loop import run_learner
        from composer_replication.training.setup import seed_everything, setup_policy

        seed_everything(config.seed)
        self.policy, _ = setup_policy(config.model)
        self.learner = run_learner(config, self.policy)
        # the learner computes in the run's precision, as the native loop's does
        self.autocast = functools.partial(autocast_for, config.model, self.policy, RankGroup())
        self.checkpoints = CheckpointManager(run_dir, keep_last=config.checkpoint.keep_last)
        self.version = 0

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def call_learner(self, method: str, args: list[Any]) -> Any:
        """``method(*args)`` of the :class:`~composer_replication.roles.Learner` role on the
        learner here (one of :data:`LEARNER_METHODS`); after ``update(batches, step)`` the
        weights are version ``step``."""
        if method not in LEARNER_METHODS:
            raise ValueError(f"{method!r} is not a method of the Learner role {LEARNER_METHODS}")
        with self.autocast():
            out = getattr(self.learner, method)(*args)
        if method == "update":
            self.version = int(args[1])
        return out

    @endpoint
    def weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, trainable weights by name)."""
        return self.version, trainable_state(self.policy)

    @endpoint
    def completion_logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        """In the weights' own precision, as a generator's: the two compare."""
        return completion_logprobs(self.policy, prompt_ids, completion_ids)

    @endpoint
    def save(self, step: int, extra: dict[str, Any]) -> str:
        """A complete checkpoint of ``step``: weights, optimizer and schedule from here, the
        controller's ``extra`` state (the learner's own ``state_dict`` among it)."""
        learner = self.learner
        path = self.checkpoints.save(
            step,
            model=self.policy,
            optimizer=learner.optimizer,
            scheduler=learner.scheduler,
            extra=extra,
        )
        return str(path)

    @endpoint
    def resume(self) -> tuple[int, dict[str, Any]] | None:
        """Restore the latest checkpoint's weights, optimizer and schedule: (step, its extra
        state), or None without one. The learner's own state is in the extra state; the
        controller restores it through :meth:`call_learner` ``load_state_dict``."""
        latest = self.checkpoints.latest()
        if latest is None:
            return None
        learner = self.learner
        state = self.checkpoints.load(
            latest, model=self.policy, optimizer=learner.optimizer, scheduler=learner.scheduler
        )
        self.version = state["step"]
        return state["step"], state["extra"]


class TeacherPoolActor(Actor):
    """Teachers: replays trace states through teacher endpoints (spend-capped, cached)."""

    @endpoint
    async def replay(self, states: list[Any], teachers: list[Any], **options: Any) -> list[Any]:
        """:func:`replay_trace` of ``states`` through ``teachers`` in this process; options
        (``max_total_usd``, ``cache_dir``, ``max_tokens``, ...) are its keyword arguments."""
        from composer_replication.traces.teacher_replay.replay import replay_trace

        return list(await replay_trace(states, teachers, **options))
