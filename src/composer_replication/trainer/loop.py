"""The training loop: the run a user starts with ``composer-replication train``.

Per step: sample tasks from each environment's train split through the curriculum ->
generate a group per task with the policy -> score in the sandbox -> each environment's
algorithm assigns per-token weights -> pack -> the algorithm-blind trainer step ->
AdamW step (clipped, scheduled). Every ``eval.every`` steps: held-out pass@1, the measured
token-mean KL to the initial policy, and ``HeldOutGuard.update``; a fired guard writes a
final checkpoint, records the reason and stops the run with ``CollapseStopError``.
Checkpoints are atomic and complete (``resume=True`` replays the same steps).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from composer_replication.config import RunConfig
from composer_replication.diloco.integration import NO_SYNC, diloco_context
from composer_replication.envs.base import Environment, pass_at_1
from composer_replication.evaluate import configured_heldout_rollouts
from composer_replication.rollout.endpoint_sampler import sampling_source
from composer_replication.rollout.generate import SamplingSettings
from composer_replication.safety import CollapseStopError, HeldOutGuard, HeldoutSplit
from composer_replication.trainer.checkpoint import CheckpointManager
from composer_replication.trainer.metrics import MetricsLog
from composer_replication.trainer.setup import (
    ProgressBar,
    jsd_teacher_setting,
    kl_to_initial,
    make_scheduler,
    merged_loss_config,
    seed_everything,
    setup_policy,
)
from composer_replication.trainer.step import train_step
from composer_replication.trainer.teachers import TeacherModels
from composer_replication.wire import pack_samples


@dataclass
class EnvRuntime:
    """An environment with its algorithm, sampling settings and task split."""

    config: Any
    env: Environment
    algorithm: Any
    train_ids: list[str]
    heldout_ids: list[str]
    sampling: SamplingSettings
    group_size: int
    curriculum: Any = None
    sampler: Any = None  # None: the live policy samples


def diloco_rank(config: Any) -> int | None:
    """This replica's DiLoCo rank (None when DiLoCo is off)."""
    if not config.enabled:
        return None
    if config.rank is not None:
        return int(config.rank)
    return int(os.environ.get(config.rank_env, "0"))


@dataclass
class RunResult:
    """How a run ended."""

    run_dir: Path
    steps: int
    heldout_before: float | None
    heldout_after: float | None
    final_model_dir: Path | None
    stopped_by_guard: str | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)


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
        self.run_dir = Path(run_dir or config.output_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.console = console
        if config.malloc_mmap_threshold is not None:
            from composer_replication.cpu_allocator import set_mmap_threshold

            set_mmap_threshold(config.malloc_mmap_threshold)
        seed_everything(config.seed)
        self.policy, self.tokenizer = setup_policy(config)
        self.split = HeldoutSplit(
            heldout_fraction=config.heldout_fraction, salt=config.heldout_salt
        )
        self.runtimes = [
            self._runtime(env_cfg, (environments or {}).get(env_cfg.name))
            for env_cfg in config.envs
        ]
        self.loss_config = merged_loss_config(config, self.runtimes)
        mode, decay = jsd_teacher_setting(config, self.runtimes)
        self.teachers = TeacherModels(self.policy, mode=mode, ema_decay=decay)
        # DiLoCo replicas must see different data: offset the task stream by the rank.
        self.task_rng = random.Random(config.seed + (diloco_rank(config.diloco) or 0))
        self.sync = NO_SYNC
        self._diloco_state: dict[str, Any] | None = None
        self.guard = HeldOutGuard(**config.guard.guard_kwargs())
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=config.optim.lr,
            betas=config.optim.betas,
            weight_decay=config.optim.weight_decay,
        )
        self.scheduler = make_scheduler(self.optimizer, config)
        self.checkpoints = CheckpointManager(self.run_dir, keep_last=config.checkpoint.keep_last)
        self.metrics = MetricsLog(
            self.run_dir / "metrics.jsonl", trackers=config.trackers, run_name=self.run_dir.name
        )
        self.step = 0
        self.heldout_before: float | None = None
        (self.run_dir / "config.json").write_text(config.model_dump_json(indent=2))

    def _runtime(self, env_cfg: Any, env: Environment | None) -> EnvRuntime:
        from composer_replication.algo import build_algorithm
        from composer_replication.envs import build_environment, load_default_pairs

        env = env or build_environment(env_cfg)
        algo_cfg = env_cfg.algorithm
        pairs = None
        if algo_cfg.type in ("replay_dpo", "composer"):
            path = self.config.pairs_file or getattr(algo_cfg.advantage, "pairs_path", None)
            pairs = load_default_pairs(path)
        scorer = None
        if getattr(algo_cfg.advantage, "model", None) == "policy":
            # a reference that is the live policy itself (opsd): score in process
            from composer_replication.algo import LocalPrefillScorer

            scorer = LocalPrefillScorer(
                self.policy, temperature=algo_cfg.sampling.temperature or 1.0
            )
        algorithm = build_algorithm(
            algo_cfg,
            tokenizer=self.tokenizer,
            pairs=pairs,
            scorer=scorer,
            rng=random.Random(self.config.seed),
        )
        train_ids, heldout_ids = self.split.split(env.task_ids())
        if not train_ids or not heldout_ids:
            raise ValueError(
                f"environment {env.name!r}: the split left {len(train_ids)} train and "
                f"{len(heldout_ids)} held-out tasks; change heldout_fraction or add tasks"
            )
        from composer_replication.datagen.curriculum import DifficultyCurriculum

        s = algo_cfg.sampling
        return EnvRuntime(
            env_cfg,
            env,
            algorithm,
            train_ids,
            heldout_ids,
            SamplingSettings(max_new_tokens=s.max_new_tokens, temperature=s.temperature),
            s.group_size,
            DifficultyCurriculum(train_ids, split=self.split),
            None if s.source == "policy" else sampling_source(s.source, self.policy),
        )

    # ------------------------------------------------------------------ state

    def extra_state(self) -> dict[str, Any]:
        return {
            "curricula": [rt.curriculum.state_dict() for rt in self.runtimes],
            "task_rng": self.task_rng.getstate(),
            "guard": self.guard.state_dict(),
            "teachers": self.teachers.state_dict(),
            "heldout_before": self.heldout_before,
            "diloco": self.sync.state_dict(),
        }

    def save(self) -> Path:
        return self.checkpoints.save(
            self.step,
            model=self.policy,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            extra=self.extra_state(),
        )

    def resume(self) -> bool:
        """Restore the latest checkpoint if there is one; True when restored."""
        latest = self.checkpoints.latest()
        if latest is None:
            return False
        state = self.checkpoints.load(
            latest, model=self.policy, optimizer=self.optimizer, scheduler=self.scheduler
        )
        self.step = state["step"]
        extra = state["extra"]
        for rt, state_dict in zip(self.runtimes, extra["curricula"]):
            rt.curriculum.load_state_dict(state_dict)
        self.task_rng.setstate(extra["task_rng"])
        self.guard.load_state_dict(extra["guard"])
        self.teachers.load_state_dict(extra["teachers"])
        self.heldout_before = extra["heldout_before"]
        self._diloco_state = extra.get("diloco")
        self.metrics.truncate_after(self.step)
        return True

    # ------------------------------------------------------------------ phases

    def evaluate(self) -> float:
        """Held-out pass@1 over every environment's held-out tasks."""
        groups = []
        for rt in self.runtimes:
            groups += configured_heldout_rollouts(
                rt.env,
                self.policy,
                self.tokenizer,
                rt.heldout_ids,
                self.config.eval,
                max_new_tokens=rt.sampling.max_new_tokens,
            )
        return pass_at_1(groups)

    def collect(self) -> tuple[list[Any], dict[str, float]]:
        samples, rewards, errors, n_rollouts = [], [], 0, 0
        sampled_tokens, generation_s = 0, 0.0
        t0 = time.perf_counter()
        for rt in self.runtimes:
            n_tasks = min(rt.config.tasks_per_step, len(rt.train_ids))
            task_ids = rt.curriculum.sample(n_tasks, rng=self.task_rng)
            self.split.check_trainable(task_ids)
            groups = rt.env.rollouts(
                self.policy if rt.sampler is None else rt.sampler,
                self.tokenizer,
                task_ids,
                group_size=rt.group_size,
                sampling=rt.sampling,
            )
            env_samples, results = [], {}
            for task_id, group in zip(task_ids, groups):
                env_samples += rt.algorithm.assign(group)
                results[task_id] = sum(r.reward for r in group) / max(len(group), 1)
                rewards += [r.reward for r in group]
                errors += sum(1 for r in group if r.error)
                n_rollouts += len(group)
                for r in group:
                    sampled_tokens += sum(r.completion_mask or ())
                    generation_s += float(r.metadata.get("generation_s", 0.0))
            asyncio.run(rt.algorithm.score(env_samples))
            samples += env_samples
            rt.curriculum.update(self.step, results)
        stats = {
            "reward/mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "reward/solved": sum(1 for r in rewards if r >= 1.0) / len(rewards) if rewards else 0.0,
            "rollouts/errors": float(errors),
            "rollouts/count": float(n_rollouts),
            "time/generate_score_s": time.perf_counter() - t0,
            "tokens/sampled": float(sampled_tokens),
        }
        if generation_s > 0:  # environments that time their sampling (python_functions)
            stats["time/generate_s"] = generation_s
            stats["tokens_per_s/generate"] = sampled_tokens / generation_s
        return samples, stats

    def train_one_step(self) -> dict[str, Any]:
        t_start = time.perf_counter()
        samples, row = self.collect()
        pad_id = self.tokenizer.pad_token_id or 0
        batches = pack_samples(samples, max_tokens=self.config.micro_batch_tokens, pad_id=pad_id)
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = train_step(
            self.policy,
            batches,
            self.loss_config,
            teacher=self.teachers.teacher(self.policy),
            reference=self.teachers.reference,
        )
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if self.config.optim.grad_clip is not None:
            row["grad_norm"] = float(
                torch.nn.utils.clip_grad_norm_(params, self.config.optim.grad_clip)
            )
        self.optimizer.step()
        row["diloco/synced"] = float(self.sync.after_inner_step())
        self.scheduler.step()
        self.teachers.update(self.policy)
        self.step += 1
        train_s = time.perf_counter() - t0
        row.update(metrics)
        row.update(
            {
                "step": self.step,
                "lr": self.scheduler.get_last_lr()[0],
                "time/train_s": train_s,
                "time/step_s": time.perf_counter() - t_start,
                "tokens_per_s/train": metrics["tokens/total"] / train_s if train_s else 0.0,
            }
        )
        self._last_batches = batches
        return row

    def guard_round(self, row: dict[str, Any]) -> None:
        heldout = self.evaluate()
        kl = kl_to_initial(
            self.policy, self.teachers.initial, self._last_batches, self.loss_config.temperature
        )
        row.update({"heldout/pass@1": heldout, "kl/to_init": kl})
        if not self.config.guard.enabled:
            return
        status = self.guard.update(
            self.step, row["reward/mean"], heldout, kl_to_init=kl, entropy=row.get("entropy")
        )
        row.update(
            {
                "guard/fired": status.fire,
                "guard/reason": status.reason,
                "guard/proxy_real_gap": status.proxy_real_gap,
            }
        )

    # ------------------------------------------------------------------ run

    def run(self, *, resume: bool = False) -> RunResult:
        from composer_replication.report import write_report

        start = time.perf_counter()
        resumed = resume and self.resume()
        if not resumed and self.config.eval.at_start:
            self.heldout_before = self.evaluate()
            self.metrics.append({"step": 0, "heldout/pass@1": self.heldout_before})
        progress = ProgressBar(self.console, self.config.steps, self.step)
        try:
            with diloco_context(self.config.diloco, self.policy, self.optimizer) as sync:
                self.sync = sync
                if self._diloco_state:
                    sync.load_state_dict(self._diloco_state)
                self._loop(start, progress)
        finally:
            self.sync = NO_SYNC
            progress.close()
            if self.metrics.rows():
                write_report(self.run_dir)
        return self._finish(start)

    def _loop(self, start: float, progress: ProgressBar) -> None:
        while self.step < self.config.steps:
            row = self.train_one_step()
            if self.step % self.config.eval.every == 0 or self.step == self.config.steps:
                self.guard_round(row)
            row["time/total_s"] = time.perf_counter() - start
            self.metrics.append(row)
            progress.update(row)
            if row.get("guard/fired"):
                self.save()
                raise CollapseStopError(self.guard.last_status)
            if self.step % self.config.checkpoint.every == 0 or self.step == self.config.steps:
                self.save()

    def _finish(self, start: float) -> RunResult:
        final_dir = self.save_final_model()
        heldout_after = next(
            (
                r["heldout/pass@1"]
                for r in reversed(self.metrics.rows())
                if r.get("heldout/pass@1") is not None
            ),
            None,
        )
        summary = {
            "steps": self.step,
            "heldout_before": self.heldout_before,
            "heldout_after": heldout_after,
            "final_model": str(final_dir),
            "wall_time_s": time.perf_counter() - start,
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return RunResult(
            self.run_dir,
            self.step,
            self.heldout_before,
            heldout_after,
            final_dir,
            None,
            self.metrics.rows(),
        )

    def save_final_model(self) -> Path:
        """The policy as a plain HF model directory (LoRA merged) under ``final_model``."""
        from composer_replication.models import save_checkpoint

        return save_checkpoint(self.policy, self.run_dir / "final_model", tokenizer=self.tokenizer)


def train(
    config: RunConfig,
    *,
    resume: bool = False,
    console: Any | None = None,
    environments: dict[str, Environment] | None = None,
) -> RunResult:
    """Run a training job; raises ``CollapseStopError`` when the kill switch fires."""
    return Trainer(config, environments=environments, console=console).run(resume=resume)
