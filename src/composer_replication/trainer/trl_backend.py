"""``train --backend trl``: the same run config, trained by ``ComposerReplicationTrainer``.

``train_with_trl(run_config)`` reads the TOML the native loop reads and maps it onto trl:

- model and LoRA: ``trainer.loop.setup_policy`` (the same policy, adapters, checkpointing);
- prompts: the ``python_functions`` environment's TRAIN tasks only (``HeldoutSplit`` with
  the run's ``heldout_fraction`` / ``heldout_salt``), one dataset row per task with its chat
  ``prompt`` and ``task_id``;
- reward: ``PythonFunctionsReward``, the environment's own sandboxed grading
  (``PythonFunctionsEnv.grade``: hidden tests under pytest), whose failing-test output is the
  SDPO feedback (``last_feedback``);
- objective: Dr. GRPO (``make_dr_grpo_config``); per step ``tasks_per_step`` prompts x
  ``group_size`` completions of ``max_new_tokens``, one optimizer step per generation;
- Composer channels from the algorithm config: ``composer`` -> alpha, beta, jsd_beta,
  dpo_beta and the pair file (``pairs_file`` or ``advantage.pairs_path``, else the shipped
  pairs); ``sdpo`` -> alpha only; ``grpo`` -> neither;
- held-out pass@1 before (``eval.at_start``) and every ``eval.every`` steps, fed to the same
  ``HeldOutGuard``: a fired guard stops the run and raises ``CollapseStopError``.

Differences from the native loop, by design of trl: generation has no stop strings (the
grader ignores text after the code block), sampling is trl's (no sibling demonstrations in
the SDPO teacher context: hints only), the guard gets no KL-to-initial reading, and only the
``policy`` teacher is available for SDPO.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from composer_replication.config import RunConfig
    from composer_replication.envs.python_functions import PythonFunctionsEnv
    from composer_replication.envs.task_bank import PythonTask
    from composer_replication.safety import HeldoutSplit
    from composer_replication.trainer.loop import RunResult

__all__ = [
    "PythonFunctionsReward",
    "grpo_config_from_run",
    "train_prompt_dataset",
    "train_with_trl",
]

_SCHEDULES = {"linear": "linear", "cosine": "cosine"}


class PythonFunctionsReward:
    """A trl reward function grading completions with ``PythonFunctionsEnv.grade``.

    Called by trl as ``reward(prompts=..., completions=..., task_id=[...], ...)`` (the
    dataset's ``task_id`` column). Reward = share of the task's hidden tests that pass in the
    sandbox. ``last_feedback`` (the ``FeedbackRewardFunc`` side channel) holds, per
    completion, the failing-test output or the format/sandbox error, None when solved.
    ``last_info`` holds the grader's info dicts (passed / total).

    Args:
        env: the environment whose tasks and sandbox grade the completions.
        candidate_fn: ``(task, completion_text) -> source`` to grade instead of the raw
            completion (default: the completion itself; the grader extracts the code).
        workers: grading threads (default: the environment's ``grading_workers``).
    """

    def __init__(
        self,
        env: PythonFunctionsEnv,
        *,
        candidate_fn: Callable[[PythonTask, str], str] | None = None,
        workers: int | None = None,
    ) -> None:
        self.env = env
        self.candidate_fn = candidate_fn
        self.workers = max(1, workers or env.grading_workers)
        self.__name__ = env.name  # trl names the reward column after it
        self.last_feedback: list[str | None] | None = None
        self.last_info: list[dict[str, Any]] | None = None

    def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        task_id: list[str] | None = None,
        **kwargs: Any,
    ) -> list[float]:
        if task_id is None or len(task_id) != len(completions):
            raise ValueError(
                "PythonFunctionsReward needs the dataset's task_id column (one id per "
                "completion); build the dataset with train_prompt_dataset"
            )
        unknown = sorted({t for t in task_id if t not in self.env.tasks})
        if unknown:
            raise ValueError(f"unknown python_functions task ids {unknown[:5]}")
        tasks = [self.env.tasks[t] for t in task_id]
        texts = [_completion_text(c) for c in completions]
        if self.candidate_fn is not None:
            texts = [self.candidate_fn(task, text) for task, text in zip(tasks, texts)]
        with ThreadPoolExecutor(self.workers) as pool:
            graded = list(pool.map(self.env.grade, tasks, texts))
        self.last_feedback = [feedback or error for _, feedback, error, _ in graded]
        self.last_info = [info for *_, info in graded]
        return [float(reward) for reward, *_ in graded]


def _completion_text(completion: Any) -> str:
    """A trl completion as text: a string, or the content of its assistant messages."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content") or "") for m in completion if isinstance(m, dict))


def train_prompt_dataset(env: PythonFunctionsEnv, split: HeldoutSplit) -> Any:
    """A ``datasets.Dataset`` of the env's train tasks: ``prompt`` (chat) and ``task_id``."""
    from datasets import Dataset

    train_ids = split.check_trainable(split.train_ids(env.task_ids()))
    if not train_ids:
        raise ValueError("the held-out split left no train task; lower heldout_fraction")
    return Dataset.from_list(
        [{"prompt": env.messages(env.tasks[t]), "task_id": t} for t in train_ids]
    )


def _composer_settings(advantage: Any) -> dict[str, Any]:
    """Trainer kwargs (alpha, beta, JSD / DPO betas, hint source) from the algorithm."""
    kind = advantage.type
    if kind not in ("grpo", "sdpo", "composer"):
        raise ValueError(
            f"the trl backend runs the grpo, sdpo and composer algorithms, not {kind!r}; "
            "use --backend native for it"
        )
    if kind == "grpo":
        return {"alpha_sdpo": 0.0, "beta_replay": 0.0}
    if advantage.teacher != "policy":
        raise ValueError(
            f"advantage.teacher={advantage.teacher!r}: the trl backend's SDPO teacher is the live "
            "policy; set teacher = 'policy' or use --backend native"
        )
    from composer_replication.trainer.composer_trainer import default_hint

    hint_fn = {"generator": default_hint, "feedback": lambda text: text, "none": None}
    out: dict[str, Any] = {
        "alpha_sdpo": advantage.alpha,
        "sdpo_jsd_beta": advantage.jsd_beta,
        "hint_fn": hint_fn[advantage.hint_source],
        "beta_replay": 0.0,
    }
    if kind == "composer":
        out.update(beta_replay=advantage.beta, replay_dpo_beta=advantage.dpo_beta)
    return out


def grpo_config_from_run(run_config: RunConfig, output_dir: str | Path) -> Any:
    """The Dr. GRPO ``GRPOConfig`` equivalent to the run's optimizer and sampling settings."""
    from composer_replication.trainer.po_presets import make_dr_grpo_config

    env_cfg = run_config.envs[0]
    sampling, optim = env_cfg.algorithm.sampling, run_config.optim
    advantage = env_cfg.algorithm.advantage
    schedule = _SCHEDULES.get(
        optim.schedule, "constant_with_warmup" if optim.warmup_steps else "constant"
    )
    extra = {"scale_rewards": "group"} if getattr(advantage, "std_normalize", False) else {}
    import torch

    on_gpu = torch.cuda.is_available()
    return make_dr_grpo_config(
        output_dir=str(output_dir),
        use_cpu=not on_gpu,
        # trl defaults to bf16 autocast, also on a CPU; train in the model's own dtype there
        bf16=on_gpu and run_config.model.dtype in ("bfloat16", "bf16"),
        max_steps=run_config.steps,
        per_device_train_batch_size=env_cfg.tasks_per_step * sampling.group_size,
        gradient_accumulation_steps=1,
        num_generations=sampling.group_size,
        max_completion_length=sampling.max_new_tokens,
        temperature=sampling.temperature,
        learning_rate=optim.lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        max_grad_norm=optim.grad_clip or 0.0,
        warmup_steps=optim.warmup_steps,
        lr_scheduler_type=schedule,
        gradient_checkpointing=run_config.model.gradient_checkpointing,
        seed=run_config.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        **extra,
    )


def _check_run(run_config: RunConfig) -> None:
    names = [e.name for e in run_config.envs]
    if names != ["python_functions"]:
        raise ValueError(
            f"the trl backend trains one python_functions environment, got {names}; "
            "use --backend native for other or several environments"
        )
    advantage = run_config.envs[0].algorithm.advantage
    if getattr(advantage, "length_penalty", 0.0):
        raise ValueError(
            "advantage.length_penalty is not supported by the trl backend; set it to 0"
        )


def train_with_trl(run_config: RunConfig, *, console: Any | None = None) -> RunResult:
    """Train ``run_config`` with ``ComposerReplicationTrainer``; returns a ``RunResult``.

    Writes ``metrics.jsonl``, ``report/``, ``summary.json`` and ``final_model/`` (LoRA merged)
    under ``run_config.output_dir``, as the native loop does. When the held-out guard fires,
    the model is saved to ``stopped_model/`` and ``CollapseStopError`` is raised.
    """
    from composer_replication.envs import build_environment, load_default_pairs
    from composer_replication.report import write_report
    from composer_replication.safety import CollapseStopError, HeldOutGuard, HeldoutSplit
    from composer_replication.trainer.composer_trainer import ComposerReplicationTrainer
    from composer_replication.trainer.loop import RunResult, seed_everything, setup_policy
    from composer_replication.trainer.metrics import MetricsLog

    _check_run(run_config)
    start = time.perf_counter()
    run_dir = Path(run_config.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(run_config.model_dump_json(indent=2))
    env_cfg = run_config.envs[0]
    settings = _composer_settings(env_cfg.algorithm.advantage)
    seed_everything(run_config.seed)
    policy, tokenizer = setup_policy(run_config)
    env = build_environment(env_cfg)
    split = HeldoutSplit(run_config.heldout_fraction, run_config.heldout_salt)
    heldout_ids = split.heldout_ids(env.task_ids())
    if settings["beta_replay"] > 0:
        path = run_config.pairs_file or env_cfg.algorithm.advantage.pairs_path
        settings["pairs"] = load_default_pairs(path)
    trainer = ComposerReplicationTrainer(
        model=policy,
        reward_funcs=[PythonFunctionsReward(env)],
        args=grpo_config_from_run(run_config, run_dir / "trl"),
        train_dataset=train_prompt_dataset(env, split),
        processing_class=tokenizer,
        **settings,
    )
    metrics = MetricsLog(
        run_dir / "metrics.jsonl", trackers=run_config.trackers, run_name=run_dir.name
    )
    guard = _GuardCallback(
        run_config,
        env,
        policy,
        tokenizer,
        heldout_ids,
        HeldOutGuard(**run_config.guard.guard_kwargs()),
        metrics,
    )
    if run_config.eval.at_start:
        guard.heldout_before = guard.evaluate()
        metrics.append({"step": 0, "heldout/pass@1": guard.heldout_before})
    trainer.add_callback(guard.as_trainer_callback())
    if console is not None:
        console.print(f"[bold]trl[/bold]: {len(trainer.train_dataset)} train prompts")
    try:
        trainer.train()
    finally:
        if metrics.rows():
            write_report(run_dir)
    from composer_replication.models import save_checkpoint

    # A fired guard still leaves the model it stopped at, next to the metrics.
    name = "final_model" if guard.stopped is None else "stopped_model"
    final_dir = save_checkpoint(policy, run_dir / name, tokenizer=tokenizer)
    summary = {
        "backend": "trl",
        "steps": trainer.state.global_step,
        "heldout_before": guard.heldout_before,
        "heldout_after": guard.heldout_last,
        "final_model": str(final_dir),
        "stopped_by_guard": guard.stopped,
        "wall_time_s": time.perf_counter() - start,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if guard.stopped is not None:
        raise CollapseStopError(guard.guard.last_status)
    return RunResult(
        run_dir,
        trainer.state.global_step,
        guard.heldout_before,
        guard.heldout_last,
        final_dir,
        None,
        metrics.rows(),
    )


class _GuardCallback:
    """Per logged step: a metrics row; every ``eval.every`` steps: held-out pass@1 + guard."""

    def __init__(
        self,
        run_config: RunConfig,
        env: Any,
        policy: Any,
        tokenizer: Any,
        heldout_ids: list[str],
        guard: Any,
        metrics: Any,
    ) -> None:
        self.config, self.env, self.policy, self.tokenizer = run_config, env, policy, tokenizer
        self.heldout_ids, self.guard, self.metrics = heldout_ids, guard, metrics
        self.heldout_before: float | None = None
        self.heldout_last: float | None = None
        self.stopped: str | None = None

    def evaluate(self) -> float:
        from composer_replication.envs import pass_at_1
        from composer_replication.evaluate import configured_heldout_rollouts

        groups = configured_heldout_rollouts(
            self.env,
            self.policy,
            self.tokenizer,
            self.heldout_ids,
            self.config.eval,
            max_new_tokens=self.config.envs[0].algorithm.sampling.max_new_tokens,
        )
        return pass_at_1(groups)

    def on_log(self, state: Any, control: Any, logs: dict[str, Any]) -> None:
        if "reward" not in logs:  # the end-of-training summary row
            return
        step = int(state.global_step)
        row = {**logs, "step": step, "reward/mean": logs["reward"]}
        if step % self.config.eval.every == 0 or step == self.config.steps:
            self.heldout_last = self.evaluate()
            row["heldout/pass@1"] = self.heldout_last
            if self.config.guard.enabled:
                status = self.guard.update(
                    step, float(logs["reward"]), self.heldout_last, entropy=logs.get("entropy")
                )
                row.update({"guard/fired": status.fire, "guard/reason": status.reason})
                if status.fire:
                    self.stopped = status.reason
                    control.should_training_stop = True
        self.metrics.append(row)

    def as_trainer_callback(self) -> Any:
        from transformers import TrainerCallback

        owner = self

        class _Callback(TrainerCallback):
            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any):
                owner.on_log(state, control, dict(logs or {}))
                return control

        return _Callback()
