"""The native training loop: the run a user starts with ``composer-replication train``.

Per step: sample tasks from each environment's train split through the curriculum ->
generate a group per task with the policy -> score in the sandbox -> each environment's
algorithm assigns per-token weights -> pack -> the algorithm-blind trainer step ->
AdamW step (clipped, scheduled). Every ``eval.every`` steps the shared run lifecycle
(:mod:`.lifecycle`) measures held-out pass@1 and the token-mean KL to the initial policy
and feeds the kill switch; a fired switch writes a final checkpoint and the run ends with
``CollapseStopError``. Checkpoints are atomic and complete (``resume=True`` replays the
same steps).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_replication import roles
from composer_replication.algo.filters import TruncationFilter, ZeroAdvantageFilter
from composer_replication.common.errors import UsageError, user_code_error
from composer_replication.common.progress import heartbeat
from composer_replication.config.identity import identity_difference, run_identity
from composer_replication.diloco.integration import NO_SYNC, diloco_context
from composer_replication.distributed.data_parallel import (
    autocast_for,
    final_policy,
    merge_rollout_stats,
    start_data_parallel,
)
from composer_replication.inference.decoding.decode_memory import release_decode_buffers
from composer_replication.inference.decoding.generate import derived_seed, seeded_rows
from composer_replication.inference.engine import BlamedSampler, build_inference_engine
from composer_replication.inference.frozen import FrozenEngines, served
from composer_replication.inference.in_process import InProcessEngine
from composer_replication.inference.snapshot import PolicySnapshot
from composer_replication.model.cpu_allocator import release_free_heap, trimming_heap
from composer_replication.model.devices import module_device
from composer_replication.rollout.agent import episode_metrics
from composer_replication.safety import HeldoutSplit
from composer_replication.samples.rollouts import stamp_policy_version
from composer_replication.samples.wire import pack_samples
from composer_replication.training.checkpoint import CheckpointManager
from composer_replication.training.learner import Learner
from composer_replication.training.lifecycle import HeldoutTasks, RunLifecycle, RunResult
from composer_replication.training.rollout_queue import RolloutQueue, drop_stale
from composer_replication.training.runtime import EnvRuntime, build_runtime
from composer_replication.training.setup import ProgressBar, seed_everything, setup_policy

if TYPE_CHECKING:
    from composer_replication.config.run import RunConfig
    from composer_replication.envs.base import Environment
    from composer_replication.samples.rollouts import Rollout

__all__ = ["RunResult", "Trainer", "diloco_rank", "train"]


def diloco_rank(config: Any) -> int | None:
    """This replica's DiLoCo rank (None when DiLoCo is off)."""
    if not config.enabled:
        return None
    if config.rank is not None:
        return int(config.rank)
    return int(os.environ.get(config.rank_env, "0"))


def run_learner(config: RunConfig, policy: Any, *, ranks: Any = None) -> Learner:
    """The run's :class:`~composer_replication.training.learner.Learner`: its config
    sections, and the run's steps and jsd teacher handed over as values."""
    return Learner(
        policy,
        model=config.model,
        optim=config.optim,
        loss=config.loss,
        steps=config.steps,
        teacher_mode=config.teacher_mode,
        ranks=ranks,
        kl_max_tokens=config.guard.kl_max_tokens,
    )


class Trainer:
    """Owns one run's state; ``run()`` executes it."""

    def __init__(
        self,
        config: RunConfig,
        *,
        run_dir: str | Path | None = None,
        environments: dict[str, Environment] | None = None,
        console: Any | None = None,
    ) -> None:
        self.config = config
        self.console = console
        if config.malloc_mmap_threshold is not None:
            from composer_replication.model.cpu_allocator import set_mmap_threshold

            set_mmap_threshold(config.malloc_mmap_threshold)
        seed_everything(config.seed)
        self.policy, self.tokenizer = setup_policy(config.model)
        # torchrun ranks; rank 0 of 1 otherwise
        self.ranks = start_data_parallel(
            config.model, config.diloco, seed=config.seed, teacher_mode=config.teacher_mode[0]
        )
        self.split = HeldoutSplit(
            heldout_fraction=config.heldout_fraction, salt=config.heldout_salt
        )
        # frozen models the engine serves: the environments read them at their endpoints
        self.frozen_engines = None
        endpoints: dict[str, Any] = {}
        if FrozenEngines.wanted(config.inference, config.envs):
            self.frozen_engines = FrozenEngines(
                config.inference, config.envs, log_dir=run_dir or config.output_dir
            )
            endpoints = self.frozen_engines.start()
        try:
            env_configs = [served(env_cfg, endpoints) for env_cfg in config.envs]
            self.runtimes = self._build_runtimes(env_configs, environments)
        except BaseException:
            self._stop_frozen_engines()
            raise
        learner = run_learner(config, self.policy, ranks=self.ranks)
        self.learner: roles.Learner = learner
        # DiLoCo replicas must see different data: offset the task stream by the rank.
        self.task_rng = random.Random(config.seed + (diloco_rank(config.diloco) or 0))
        self._diloco_state: dict[str, Any] | None = None
        self.optimizer = learner.optimizer
        self.scheduler = learner.scheduler
        # Everything above can fail on bad input; only now does the run directory appear.
        self.life = RunLifecycle(config, backend="native", run_dir=run_dir, ranks=self.ranks)
        self.run_dir = self.life.run_dir
        self.checkpoints = CheckpointManager(self.run_dir, keep_last=config.checkpoint.keep_last)
        self.step = 0
        # steps sampled ahead of training ('auto' resolved for the policy's device), the
        # queue that samples them, and what a resumed run takes first: the batches pending
        # at its checkpoint (sampled ones, or the tasks of an older checkpoint)
        self.async_level = self.steps_sampled_ahead()
        # what samples the policy: in this process (a copy of the weights when sampling
        # ahead) or a vLLM server
        self.engine: roles.InferenceEngine = build_inference_engine(
            config.inference,
            policy=self.policy,
            model_source=config.model.source,
            run_dir=self.run_dir,
            seed=config.seed,
            sample_ahead=self.async_level > 0,
            autocast=lambda: autocast_for(self.config.model, self.policy, self.ranks),
        )
        self.rollout_queue: RolloutQueue | None = None
        self._pending_tasks: deque[list[list[str]]] = deque()
        self._pending_batches: deque[tuple[list[list[str]], list[list[list[Rollout]]]]] = deque()

    def steps_sampled_ahead(self) -> int:
        """``[inference] async_level`` resolved for the policy's device and ranks."""
        return self.config.inference.resolved_async_level(
            module_device(self.policy).type, distributed=self.ranks.distributed
        )

    @property
    def sync(self) -> Any:
        return self.learner.sync

    @sync.setter
    def sync(self, value: Any) -> None:
        self.learner.sync = value

    @property
    def live_sampler(self) -> roles.Sampler:
        """What samples the live policy (the engine's sampler; a user's engine's sampler
        whose failures name the engine: ``BlamedSampler``)."""
        engine = self.config.inference.engine
        if ":" in engine:
            return BlamedSampler(self.engine.sampler, f"inference.engine = {engine!r}")
        return self.engine.sampler

    @property
    def snapshot(self) -> PolicySnapshot | None:
        """The copy of the weights that samples ahead in process (None otherwise)."""
        return self.engine.snapshot if isinstance(self.engine, InProcessEngine) else None

    def _build_runtimes(
        self, env_configs: list[Any], environments: dict[str, Environment] | None
    ) -> list[EnvRuntime]:
        runtimes = []
        for i, env_cfg in enumerate(env_configs):
            with self._beat(f"setting up envs.{i} ({env_cfg.name})", announce=False):
                runtimes.append(
                    build_runtime(
                        env_cfg,
                        policy=self.policy,
                        tokenizer=self.tokenizer,
                        split=self.split,
                        seed=self.config.seed,
                        env=(environments or {}).get(env_cfg.name),
                        say=self._say,
                    )
                )
        return runtimes

    def _beat(self, what: str, *, announce: bool = True) -> Any:
        """``heartbeat`` on the console of rank 0 (a line at least every 30 s in a log)."""
        console = self.console if self.ranks.is_writer else None
        return heartbeat(console, what, announce=announce)

    def _say(self, line: str) -> None:
        """A progress line of set-up work (tasks made from a repository): on the console,
        rank 0 only."""
        if self.console is not None and self.ranks.is_writer:
            self.console.print(line, soft_wrap=True, highlight=False)

    def _stop_frozen_engines(self) -> None:
        if self.frozen_engines is not None:
            self.frozen_engines.stop()

    @property
    def heldout_tasks(self) -> list[HeldoutTasks]:
        # each environment once, even when several entries train on it (say a demonstration
        # entry beside an rl one), with the answer budget of an entry the policy samples
        chosen: dict[tuple[str, str], EnvRuntime] = {}
        for rt in sorted(self.runtimes, key=lambda rt: not rt.sampler.samples_from_live_policy):
            chosen.setdefault(rt.evaluation_key, rt)
        return [
            HeldoutTasks(rt.env, rt.heldout_ids, rt.sampling.max_new_tokens)
            for rt in self.runtimes
            if chosen[rt.evaluation_key] is rt
        ]

    # ------------------------------------------------------------------ state

    def extra_state(self) -> dict[str, Any]:
        return {
            "identity": run_identity(self.config.model_dump(mode="json")),
            "curricula": [rt.curriculum.state_dict() for rt in self.runtimes],
            "algorithms": [rt.algorithm.state_dict() for rt in self.runtimes],
            "task_rng": self.task_rng.getstate(),
            "lifecycle": self.life.state_dict(),
            **self.learner.state_dict(),  # teachers, losses
            **self._diloco_checkpoint_state(),
            "pending_batches": self.rollout_queue.pending_batches() if self.rollout_queue else [],
        }

    def _diloco_checkpoint_state(self) -> dict[str, Any]:
        """The DiLoCo outer state: each rank's own under several ranks (its shards' outer
        parameters and momentum), gathered for rank 0 to write."""
        if not self.ranks.distributed:
            return {"diloco": self.sync.state_dict()}
        mine = [self.sync.state_dict()]
        return {"diloco_per_rank": self.ranks.gather_shares(mine, self.ranks.world_size)}

    def save(self) -> Path:
        return self.checkpoints.save(
            self.step,
            model=self.policy,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            extra=self.extra_state(),
            ranks=self.ranks,
        )

    def resume(self) -> bool:
        """Restore the latest checkpoint if there is one; True when restored."""
        latest = self.checkpoints.latest()
        if latest is None:
            return False
        state = self.checkpoints.load(
            latest,
            model=self.policy,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            ranks=self.ranks,
        )
        self.restore(state["step"], state["extra"])
        return True

    def restore(self, step: int, extra: dict[str, Any]) -> None:
        """Continue from ``step`` with a checkpoint's extra state (weights already loaded).

        Raises:
            UsageError: the checkpoint belongs to a run of another identity (its model,
                environments, algorithms, tasks, loss or split: ``config.identity``).
        """
        recorded = extra.get("identity")
        if recorded is not None:
            current = run_identity(self.config.model_dump(mode="json"))
            difference = identity_difference(recorded, current)
            if difference is not None:
                raise UsageError(
                    f"the checkpoint of step {step} belongs to another run ({difference}); "
                    "resume with the settings it was written with, or start a new run"
                )
        self.step = step
        for rt, state_dict in zip(self.runtimes, extra["curricula"]):
            rt.curriculum.load_state_dict(state_dict)
        for rt, state_dict in zip(self.runtimes, extra.get("algorithms", [])):
            rt.algorithm.load_state_dict(state_dict)
        self.task_rng.setstate(extra["task_rng"])
        self.life.load_state_dict(extra["lifecycle"], self.step)
        self.learner.load_state_dict(extra)
        self._pending_tasks = deque(extra.get("pending_tasks") or [])  # older checkpoints
        self._pending_batches = deque(extra.get("pending_batches") or [])
        per_rank = extra.get("diloco_per_rank")
        if per_rank is None:
            self._diloco_state = extra.get("diloco")
        elif any(per_rank) and len(per_rank) != self.ranks.world_size:
            raise ValueError(
                f"this checkpoint's DiLoCo outer state was written by {len(per_rank)} ranks per "
                f"replica (one part per shard); resume it with {len(per_rank)} ranks, not "
                f"{self.ranks.world_size}"
            )
        else:
            self._diloco_state = per_rank[self.ranks.rank] if per_rank else None

    # ------------------------------------------------------------------ phases

    def evaluate(self) -> float:
        """Held-out pass@1 over every environment's held-out tasks (sampled by the engine
        when there is one: it holds the current weights)."""
        # the sampling is seeded by eval.seed inside (the same numbers at every evaluation)
        return self.life.evaluate(
            self.live_sampler, self.tokenizer, self.heldout_tasks, step=self.step
        )

    def pick_tasks(self, step: int) -> list[list[str]]:
        """Step ``step``'s train task ids of every environment (curriculum, held-out
        refused; none for an entry whose steps, ``first_step``..``last_step``, exclude it)."""
        picked: list[list[str]] = []
        for rt in self.runtimes:
            if not rt.config.active_at(step):
                picked.append([])
                continue
            n_tasks = min(rt.config.tasks_per_step, len(rt.train_ids))
            task_ids = rt.curriculum.sample(n_tasks, rng=self.task_rng)
            self.split.check_trainable(task_ids)
            picked.append(task_ids)
        return picked

    def run_rollouts(
        self,
        tasks: list[list[str]],
        *,
        batch_index: int | None = None,
        live_sampler: roles.Sampler | None = None,
    ) -> list[list[list[Rollout]]]:
        """One group per task of every environment, sampled by each environment's sampler
        (the live policy here, ``live_sampler`` where given, or its frozen source).

        In-process sampling draws each row's randomness from a generator seeded by the run's
        seed, the batch's index (the step it trains) and the row's prompt, so a group's
        completions do not depend on which rank or batch samples it.
        """
        index = self.step if batch_index is None else batch_index
        with seeded_rows(derived_seed(self.config.seed, "rollouts", index)):
            return [
                rt.sampler.rollouts(
                    rt.env, live_sampler or self.live_sampler, self.tokenizer, task_ids
                )
                if task_ids
                else []
                for rt, task_ids in zip(self.runtimes, tasks)
            ]

    def next_tasks(self, step: int) -> list[list[str]]:
        """The tasks of this rank for step ``step``: a resumed run's pending ones first, then
        the curriculum's (every rank picks the same tasks and samples its own share)."""
        if self._pending_tasks:
            return self._pending_tasks.popleft()
        return [self.ranks.share(task_ids) for task_ids in self.pick_tasks(step)]

    def collect(self) -> tuple[list[Any], dict[str, float]]:
        if self.rollout_queue is not None:
            return self.collect_ahead(self.rollout_queue)
        t0 = time.perf_counter()
        tasks = self.next_tasks(self.step + 1)
        return self.assign(tasks, self.run_rollouts(tasks), t0)

    def collect_ahead(self, queue: RolloutQueue) -> tuple[list[Any], dict[str, float]]:
        """This step's rollouts from the queue (sampled while earlier steps trained), too old
        groups dropped; then the queue is topped up to ``async_level`` steps ahead."""
        while self._pending_batches:  # a resumed run's, sampled before its checkpoint
            queue.put_sampled(*self._pending_batches.popleft())
        if not len(queue):
            queue.submit(self.next_tasks(self.step + 1), self.step)
        tasks, groups, submitted, waited = queue.pop()
        tasks, groups, off_policy = drop_stale(
            tasks,
            groups,
            trainer_version=self.step,
            max_off_policy_steps=self.config.inference.max_off_policy_steps,
        )
        samples, row = self.assign(tasks, groups, submitted)
        while len(queue) < queue.depth:  # the batch trained at step self.step + 1 + len
            queue.submit(self.next_tasks(self.step + 2 + len(queue)), self.step + 1 + len(queue))
        return samples, {**row, **off_policy, "time/wait_rollouts_s": waited}

    @contextlib.contextmanager
    def _user_algorithm(self, rt: EnvRuntime) -> Iterator[None]:
        """A user's algorithm (``type = 'pkg.mod:Class'``) that raises is named in one line:
        the setting, the class, the error; a built-in one's errors pass as they are."""
        kind = rt.config.algorithm.type
        if ":" not in kind:
            yield
            return
        try:
            yield
        except UsageError:
            raise
        except Exception as err:
            index = self.runtimes.index(rt)
            raise user_code_error(
                f"envs.{index}.algorithm.advantage.type = {kind!r}",
                err,
                "in process_group(group) or score(samples)",
            ) from err

    def assign(
        self, tasks: list[list[str]], env_groups: list[list[list[Rollout]]], t0: float
    ) -> tuple[list[Any], dict[str, float]]:
        """Training samples and rollout metrics from every environment's groups (the
        algorithms process each group and score the batch; the curricula see each task's
        mean reward)."""
        samples, rewards, errors, n_rollouts = [], [], 0, 0
        infrastructure, flagged = 0, 0
        zero_advantage = ZeroAdvantageFilter(enforce=self.config.filters.zero_advantage.enforce)
        cut_short = self.config.filters.truncated
        truncation = TruncationFilter(mode=cut_short.mode, penalty=cut_short.penalty)
        sampled_rollouts: list[Rollout] = []  # the live policy's (or a frozen model's)
        scoring_s = 0.0  # the algorithms' process_group + score: time/scoring_s
        sampled_tokens, generation_s, demonstrations, grading_max_s = 0, 0.0, 0, 0.0
        for rt, task_ids, groups in zip(self.runtimes, tasks, env_groups):
            env_samples, results = [], {}
            for task_id, sampled_group in zip(task_ids, groups):
                if sampled_group and all(r.is_demonstration for r in sampled_group):
                    # reference solutions: trained on, but not the policy's reward
                    demonstrations += len(sampled_group)
                    t_scoring = time.perf_counter()
                    with self._user_algorithm(rt):
                        env_samples += rt.algorithm.process_group(list(sampled_group))
                    scoring_s += time.perf_counter() - t_scoring
                    continue
                # A rollout whose sandbox never ran says nothing about the policy: left out.
                group = [r for r in sampled_group if not r.infrastructure_error]
                infrastructure += len(sampled_group) - len(group)
                flagged += sum(1 for r in group if r.hack_flags)
                errors += sum(1 for r in sampled_group if r.error)
                n_rollouts += len(sampled_group)
                stamp_policy_version(sampled_group, self.engine.version)
                sampled_rollouts += sampled_group
                for r in sampled_group:
                    sampled_tokens += sum(r.completion_mask or ())
                    generation_s += float(r.metadata.get("generation_s", 0.0))
                    grading_max_s = max(grading_max_s, float(r.metadata.get("grading_s", 0.0)))
                if not group:
                    continue
                results[task_id] = sum(r.reward for r in group) / len(group)
                rewards += [r.reward for r in group]
                truncation.penalize(group)  # after the reward metrics: they report scores
                t_scoring = time.perf_counter()
                with self._user_algorithm(rt):
                    processed = rt.algorithm.process_group(group)
                env_samples += truncation(zero_advantage(processed))
                scoring_s += time.perf_counter() - t_scoring
            t_scoring = time.perf_counter()
            with self._user_algorithm(rt):
                asyncio.run(rt.algorithm.score(env_samples))
            scoring_s += time.perf_counter() - t_scoring
            samples += env_samples
            rt.curriculum.update(self.step, self.ranks.union(results))
        stats = {
            "reward/mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "reward/solved": sum(1 for r in rewards if r >= 1.0) / len(rewards) if rewards else 0.0,
            "rollouts/errors": float(errors),
            "rollouts/count": float(n_rollouts),
            "rollouts/infrastructure_errors": float(infrastructure),
            "hack/flagged": float(flagged),
            "hack/flagged_fraction": flagged / n_rollouts if n_rollouts else 0.0,
            "time/generate_score_s": time.perf_counter() - t0,
            "time/scoring_s": scoring_s,
            "tokens/sampled": float(sampled_tokens),
            **zero_advantage.metrics(),
            **truncation.metrics(),
            **episode_metrics(sampled_rollouts),
        }
        self.life.save_rollouts("train", self.step + 1, [sampled_rollouts], self.tokenizer)
        if demonstrations:
            stats["rollouts/demonstrations"] = float(demonstrations)
        if grading_max_s > 0:  # environments that time their grading (python_functions)
            stats["time/grade_max_s"] = grading_max_s
        if generation_s > 0:  # environments that time their sampling (python_functions)
            stats["time/generate_s"] = generation_s
            stats["tokens_per_s/generate"] = sampled_tokens / generation_s
        return samples, stats

    def train_one_step(self) -> dict[str, Any]:
        t_start = time.perf_counter()
        with self.learner.weights.gathered():  # a sharded policy samples collective-free
            samples, row = self.collect()
        if self.ranks.distributed:  # the step's rollouts of every rank, as one process
            every = self.ranks.gather_shares([row], self.ranks.world_size)
            row = merge_rollout_stats(every)
        pad_id = self.tokenizer.pad_token_id or 0
        batches = pack_samples(
            samples, max_tokens=self.config.micro_batch_tokens, pad_id=pad_id, split=self.split
        )
        if not self.async_level:
            # nothing samples until the next step: the decode's kept GPU buffers (KV caches,
            # CUDA graphs) go back for the step's activations; sampling ahead keeps them
            release_decode_buffers()
        t0 = time.perf_counter()
        self.step += 1
        metrics = self.learner.update(batches, self.step)
        train_s = time.perf_counter() - t0
        del batches
        release_free_heap()  # the update's freed activations leave the process (CPU peak)
        if self.rollout_queue is not None:
            self.rollout_queue.wait_idle()  # one policy version per sampled batch
        # the engine samples the next step with these weights
        row.update(self.engine.after_step(self.policy, self.step))
        row.update(metrics)
        row.update(
            {
                "step": self.step,
                "lr": self.learner.lr(),
                "time/train_s": train_s,
                "time/step_s": time.perf_counter() - t_start,
                "tokens_per_s/train": metrics["tokens/total"] / train_s if train_s else 0.0,
            }
        )
        return row

    def guard_round(self, row: dict[str, Any]) -> bool:
        """Evaluate, measure the KL to the initial policy, feed the kill switch."""
        with self.learner.weights.gathered(), self._beat(f"held-out evaluation (step {self.step})"):
            heldout = self.evaluate()
        release_free_heap()  # the evaluation's KV caches and prompt states
        kl = self.learner.kl_to_initial()
        return self.life.guard_round(self.step, row, heldout, kl_to_init=kl)

    # ------------------------------------------------------------------ run

    def run(self, *, resume: bool = False) -> RunResult:
        # a CPU run's heap gives its holes back while phases run, not only between them
        every = (
            self.config.malloc_trim_every_s if module_device(self.policy).type == "cpu" else None
        )
        with self.life.exclusive(), trimming_heap(every):
            return self._run(resume=resume)

    def _run(self, *, resume: bool) -> RunResult:
        resumed = resume and self.resume()
        self.life.begin(resumed=resumed)
        self.engine.start(self.policy, self.step)
        if not resumed and self.config.eval.at_start:
            with self.learner.weights.gathered(), self._beat("held-out evaluation (start)"):
                self.life.evaluate_start(
                    self.live_sampler, self.tokenizer, self.heldout_tasks, policy=self.policy
                )
            if self.life.start_evaluation == "reused":
                self._say(
                    "held-out evaluation (start): reused, the same weights, tasks and settings "
                    "were evaluated before (eval.reuse_start = false measures them again)"
                )
            release_free_heap()
        progress = ProgressBar(self.console, self.config.steps, self.step)
        if self.async_level:
            self.rollout_queue = RolloutQueue(
                self._sample_ahead, self._sampler_version, depth=self.async_level
            )
        try:
            with diloco_context(self.config.diloco, self.policy, self.optimizer) as sync:
                self.sync = sync
                if self._diloco_state:
                    sync.load_state_dict(self._diloco_state)
                with autocast_for(self.config.model, self.policy, self.ranks):
                    self._loop(progress)
        finally:
            self.sync = NO_SYNC
            if self.rollout_queue is not None:
                self.rollout_queue.close()
                self.rollout_queue = None
            self.engine.stop()
            self._stop_frozen_engines()
            progress.close()
            self.life.write_report()
        return self.life.finish(final_policy(self.policy, self.ranks), self.tokenizer, self.step)

    def _sample_ahead(self, tasks: list[list[str]], index: int) -> list[list[list[Rollout]]]:
        """One batch sampled in the rollout queue's thread, by the engine's sampler for it."""
        with self.engine.sampling_ahead() as sampler:
            return self.run_rollouts(tasks, batch_index=index, live_sampler=sampler)

    def _sampler_version(self) -> int:
        """The policy version the sampler of the next batch serves."""
        return self.engine.version

    def _loop(self, progress: ProgressBar) -> None:
        while self.step < self.config.steps:
            row = self.train_one_step()
            self.life.close_step_if_out_of_time(self.step)
            fired = self.life.numeric_round(self.step, row)
            fired = self.life.hack_round(self.step, row) or fired
            fired = (self.life.is_eval_step(self.step) and self.guard_round(row)) or fired
            self.life.append(row)
            progress.update(row)
            last = self.life.is_last_step(self.step)
            if fired or last or self.step % self.config.checkpoint.every == 0:
                self.save()
            if fired or last:
                return


def train(
    config: RunConfig,
    *,
    resume: bool = False,
    console: Any | None = None,
    environments: dict[str, Environment] | None = None,
    run_dir: str | Path | None = None,
) -> RunResult:
    """Run a training job; raises ``CollapseStopError`` when the kill switch fires (after
    the final checkpoint, model and summary are written)."""
    return Trainer(config, environments=environments, console=console, run_dir=run_dir).run(
        resume=resume
    )
