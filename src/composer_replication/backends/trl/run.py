"""``train --backend trl``: the same run config, trained by ``ComposerReplicationTrainer``.

``train_with_trl(run_config)`` reads the TOML the native loop reads and maps it onto trl:

- model and LoRA: ``training.setup.setup_policy`` (the same policy, adapters, checkpointing);
- prompts: the ``python_functions`` environment's TRAIN tasks only (``HeldoutSplit`` with
  the run's ``heldout_fraction`` / ``heldout_salt``), one dataset row per task with its chat
  ``prompt`` and ``task_id``;
- reward: ``PythonFunctionsReward``, the environment's own sandboxed grading
  (``PythonFunctionsEnv.grade``: hidden tests under pytest), whose failing-test output is the
  SDPO feedback (``last_feedback``);
- objective: Dr. GRPO (``make_dr_grpo_config``); per step ``tasks_per_step`` prompts x
  ``group_size`` completions of ``max_new_tokens``, one optimizer step per generation;
- algorithms: those whose config declares the ``trl`` backend (``backends``: grpo, sdpo,
  composer); the Composer channels they train (``trains``) take the weights from the
  algorithm config (``jsd`` -> ``alpha_sdpo``, ``dpo`` -> ``beta_replay`` and
  ``advantage.pairs_path``, else the shipped pairs), a channel they do not train weight 0;
  every loss setting comes from the run's resolved ``[loss]`` table under the same names
  (``sdpo_jsd_beta``, ``sdpo_wrapper``, ``replay_dpo_beta``, ``dpo_variant``, ...:
  :data:`TRAINER_LOSS_SETTINGS`); a scheduled TAID ``t`` follows the logged
  ``loss/jsd``; the channels are logged as the native loop logs them (``loss/rl``,
  ``loss/jsd``, ``loss/dpo``), so the report's loss plot has the same curves;
- the run lifecycle of the native loop (:mod:`.lifecycle`): held-out pass@1 before
  (``eval.at_start``) and every ``eval.every`` steps fed to the same ``HeldOutGuard``, the
  same ``metrics.jsonl`` / ``report/`` / ``final_model/`` / ``summary.json``; a fired guard
  stops the run and raises ``CollapseStopError``.

Differences from the native loop, by design of trl: generation has no stop strings (the
grader ignores text after the code block), sampling is trl's (no sibling demonstrations in
the SDPO teacher context: hints only), and only the ``policy`` teacher is available for SDPO.
The guard's KL-to-initial reading is measured as the native loop measures it (exact over
the vocabulary, ``setup.kl_to_initial_sum``), on the rollouts of the last trained
micro-batch (``ComposerReplicationTrainer.last_sampled``), summed over the processes.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_replication.config.loss import DIVERGENCE_KNOBS, PAIR_KNOBS

if TYPE_CHECKING:
    from composer_replication.config.run import RunConfig
    from composer_replication.envs.python_functions import PythonFunctionsEnv
    from composer_replication.envs.task_bank import PythonTask
    from composer_replication.safety import HeldoutSplit
    from composer_replication.training.lifecycle import RunLifecycle, RunResult

__all__ = [
    "PythonFunctionsReward",
    "grpo_config_from_run",
    "launched_processes",
    "sampled_micro_batches",
    "tasks_per_process",
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
    ``last_info`` holds the grader's info dicts (passed / total, hack flags). trl has no
    way to leave a sample out of its loss, so a completion whose sandbox never started
    scores 0 here (``last_info`` marks it ``infrastructure_error``); the native backend
    leaves such rollouts out.

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
        self._tally = {"graded": 0, "flagged": 0, "infrastructure_errors": 0}

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
        self._tally["graded"] += len(graded)
        self._tally["flagged"] += sum(bool(info.get("hack_flags")) for info in self.last_info)
        self._tally["infrastructure_errors"] += sum(
            bool(info.get("infrastructure_error")) for info in self.last_info
        )
        return [float(reward) for reward, *_ in graded]

    def drain_tally(self) -> dict[str, float]:
        """Hack and infrastructure counts of everything graded since the last call, as
        metrics (``hack/flagged``, ``hack/flagged_fraction``,
        ``rollouts/infrastructure_errors``); empty when nothing was graded."""
        tally, self._tally = self._tally, dict.fromkeys(self._tally, 0)
        if not tally["graded"]:
            return {}
        return {
            "hack/flagged": float(tally["flagged"]),
            "hack/flagged_fraction": tally["flagged"] / tally["graded"],
            "rollouts/infrastructure_errors": float(tally["infrastructure_errors"]),
        }


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


def _composer_settings(run_config: RunConfig) -> dict[str, Any]:
    """Trainer kwargs (channel weights, loss settings, hint source) of the run.

    Read from the algorithm's declarations, never its name: it must declare the ``trl``
    backend; each Composer channel it trains (``jsd``, ``dpo``) is weighted by its config's
    channel weight (``CHANNEL_WEIGHTS``), a channel it does not train by 0; the loss
    settings are the run's ``[loss]`` (:data:`TRAINER_LOSS_SETTINGS`).
    """
    from composer_replication.config.advantage import BUILTIN_ADVANTAGES
    from composer_replication.config.run import CHANNEL_WEIGHTS

    advantage = run_config.envs[0].algorithm.advantage
    if "trl" not in advantage.backends:
        runs = [n for n, c in BUILTIN_ADVANTAGES.items() if "trl" in c.backends]
        raise ValueError(
            f"the trl backend runs the {', '.join(runs)} algorithms, not {advantage.type!r}; "
            "use --backend native for it"
        )
    teacher = advantage.teacher_mode
    if teacher is not None and teacher[0] != "policy":
        raise ValueError(
            f"advantage.teacher={teacher[0]!r}: the trl backend's SDPO teacher is the live "
            "policy; set teacher = 'policy' or use --backend native"
        )
    loss = run_config.loss
    out: dict[str, Any] = {
        field: getattr(advantage, field) if component in advantage.trains else 0.0
        for component, field in CHANNEL_WEIGHTS.items()
    }
    out.update({name: getattr(loss, name) for name in TRAINER_LOSS_SETTINGS})
    if "jsd" in advantage.trains:
        from composer_replication.backends.trl.trainer import default_hint

        hint_fn = {"generator": default_hint, "feedback": lambda text: text, "none": None}
        out["hint_fn"] = hint_fn[advantage.hint_source]
    if out["sdpo_wrapper"] == "taid" and out["taid_t"] is None:
        from composer_replication.ops.taid import TAIDScheduler

        out["taid_t"] = TAIDScheduler(
            max(1, run_config.steps), t_start=loss.taid_t_start, t_end=loss.taid_t_end
        )
    return out


def grpo_config_from_run(run_config: RunConfig, output_dir: str | Path) -> Any:
    """The Dr. GRPO ``GRPOConfig`` equivalent to the run's optimizer and sampling settings."""
    from composer_replication.backends.trl.po_presets import make_dr_grpo_config

    env_cfg = run_config.envs[0]
    sampling, optim = env_cfg.algorithm.sampling, run_config.optim
    advantage = env_cfg.algorithm.advantage
    process_tasks = tasks_per_process(env_cfg.tasks_per_step, launched_processes())
    schedule = _SCHEDULES.get(
        optim.schedule, "constant_with_warmup" if optim.warmup_steps else "constant"
    )
    extra = {"scale_rewards": "group"} if getattr(advantage, "std_normalize", False) else {}
    if run_config.model.dtype not in ("bfloat16", "bf16"):
        extra["bf16"] = False  # train in the model's own dtype (device: the machine's)
    return make_dr_grpo_config(
        output_dir=str(output_dir),
        max_steps=run_config.steps,
        # the step's tasks are split over the processes: N processes, one run's batch
        per_device_train_batch_size=process_tasks * sampling.group_size,
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


def sampled_micro_batches(
    sampled: tuple[Any, ...], *, max_tokens: int, pad_id: int = 0
) -> list[Any]:
    """Micro-batches of trl's padded rollouts (``composer_trainer.SAMPLED_KEYS``): each
    row's prompt and completion tokens, the completion trainable (what the KL to the
    initial policy is measured on). Rows without completion tokens are left out."""
    from composer_replication.samples.wire import TrainingSample, pack_samples

    prompt_ids, prompt_mask, completion_ids, completion_mask = (t.tolist() for t in sampled)
    samples = []
    for p_ids, p_mask, c_ids, c_mask in zip(
        prompt_ids, prompt_mask, completion_ids, completion_mask
    ):
        prompt = [t for t, m in zip(p_ids, p_mask) if m]
        completion = [t for t, m in zip(c_ids, c_mask) if m]
        if not completion:
            continue
        n = len(prompt) + len(completion)
        samples.append(
            TrainingSample(
                input_ids=prompt + completion,
                loss_mask=[0] * len(prompt) + [1] * len(completion),
                inference_logprobs=[0.0] * n,
                rl_weights=[0.0] * n,
            )
        )
    return pack_samples(samples, max_tokens=max_tokens, pad_id=pad_id, split=None)


def launched_processes() -> int:
    """How many processes ``accelerate launch`` / ``torchrun`` started (1 without them)."""
    import os

    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        count = int(raw)
    except ValueError:
        raise ValueError(f"WORLD_SIZE={raw!r} is not a process count") from None
    if count < 1:
        raise ValueError(f"WORLD_SIZE={count}: need at least 1 process")
    return count


def tasks_per_process(tasks_per_step: int, processes: int) -> int:
    """Each process's equal share of a step's tasks (so N processes train one run's batch)."""
    if tasks_per_step % processes:
        raise ValueError(
            f"tasks_per_step = {tasks_per_step} does not split over {processes} processes: "
            "make it a multiple of --num_processes (each process samples an equal share of "
            "every step's tasks)"
        )
    return tasks_per_step // processes


#: ``[loss]`` settings passed to ``ComposerReplicationTrainer`` under their own names (the
#: SDPO and DPO channels' knobs): every run gives them from its ``LossConfig``, so the
#: trainer's own keyword defaults never apply.
TRAINER_LOSS_SETTINGS = (*DIVERGENCE_KNOBS, *PAIR_KNOBS)
#: ``[loss]`` settings the trl backend applies: those it passes to the trainer, the TAID
#: schedule's ends (a scheduled ``taid_t``) and ``temperature`` (which must equal the
#: sampling temperature, trl's own).
TRL_APPLIED_LOSS_SETTINGS = frozenset(
    {*TRAINER_LOSS_SETTINGS, "taid_t_start", "taid_t_end", "temperature"}
)


def check_loss_settings(loss: Any) -> None:
    """Refuse, in one line naming it, a ``[loss]`` setting this backend would not apply (a
    value other than its default outside :data:`TRL_APPLIED_LOSS_SETTINGS`: trl's GRPO
    loss has its own clipping and no ce / ref_kl components)."""
    defaults = type(loss)()
    for name in type(loss).model_fields:
        if name in TRL_APPLIED_LOSS_SETTINGS:
            continue
        value = getattr(loss, name)
        if value != getattr(defaults, name):
            raise ValueError(
                f"loss.{name}={value!r}: the trl backend does not apply this setting (trl's "
                "GRPO loss computes rl itself); leave it at its default or use --backend native"
            )


def _check_run(run_config: RunConfig) -> None:
    check_loss_settings(run_config.loss)
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

    Writes what the native loop writes (``metrics.jsonl``, ``report/``, ``final_model/``,
    ``summary.json``) through the same :class:`~composer_replication.training.lifecycle.
    RunLifecycle`; when the held-out guard fires, training stops and ``CollapseStopError``
    is raised after the final model and summary are written.
    """
    from composer_replication.algo.replay_dpo import load_pair_records
    from composer_replication.backends.trl.trainer import ComposerReplicationTrainer
    from composer_replication.envs import build_environment
    from composer_replication.inference.decoding.generate import InProcessSampler
    from composer_replication.safety import HeldoutSplit
    from composer_replication.training.lifecycle import HeldoutTasks, RunLifecycle
    from composer_replication.training.setup import seed_everything, setup_policy

    _check_run(run_config)
    env_cfg = run_config.envs[0]
    settings = _composer_settings(run_config)
    seed_everything(run_config.seed)
    policy, tokenizer = setup_policy(run_config.model)
    env = build_environment(env_cfg)
    split = HeldoutSplit(run_config.heldout_fraction, run_config.heldout_salt)
    heldout = [
        HeldoutTasks(
            env, split.heldout_ids(env.task_ids()), env_cfg.algorithm.sampling.max_new_tokens
        )
    ]
    if settings["beta_replay"] > 0:
        settings["pairs"] = load_pair_records(env_cfg.algorithm.advantage.pairs_path)
    args = grpo_config_from_run(run_config, Path(run_config.output_dir) / "trl")
    # under `accelerate launch` this joins the process group (gloo on CPU, NCCL on GPUs),
    # which the lifecycle needs to know which rank writes the run's files
    _ = args.device
    life = RunLifecycle(run_config, backend="trl")
    trainer = ComposerReplicationTrainer(
        model=policy,
        reward_funcs=[PythonFunctionsReward(env)],
        args=args,
        train_dataset=train_prompt_dataset(env, split),
        processing_class=tokenizer,
        split=split,
        **settings,
    )
    with life.exclusive():  # the run directory is this run's alone
        life.begin(resumed=False)
        life.evaluate_start(InProcessSampler(policy), tokenizer, heldout, policy=policy)
        callback = _LifecycleCallback(
            life,
            policy,
            tokenizer,
            heldout,
            settings.get("taid_t"),
            trainer.reward_funcs[0],
            trainer=trainer,
        )
        trainer.add_callback(callback.as_trainer_callback())
        if console is not None and life.ranks.is_writer:
            console.print(f"[bold]trl[/bold]: {len(trainer.train_dataset)} train prompts")
        try:
            trainer.train()
        finally:
            life.write_report()
        return life.finish(policy, tokenizer, trainer.state.global_step)


class _LifecycleCallback:
    """Per logged step: a metrics row; every ``eval.every`` steps: held-out pass@1 + guard."""

    def __init__(
        self,
        life: RunLifecycle,
        policy: Any,
        tokenizer: Any,
        heldout: list[Any],
        taid_t: Any = None,
        reward: PythonFunctionsReward | None = None,
        trainer: Any = None,
    ) -> None:
        from composer_replication.inference.decoding.generate import InProcessSampler
        from composer_replication.ops.taid import TAIDScheduler
        from composer_replication.training.teachers import TeacherModels

        self.life, self.tokenizer, self.heldout = life, tokenizer, heldout
        self.policy, self.trainer = policy, trainer
        # the initial policy the guard measures KL to: the base under a LoRA policy's
        # adapters, else a frozen copy (as the native loop keeps it)
        self.initial = TeacherModels(policy).initial if policy is not None else None
        self.sampler = InProcessSampler(policy)  # held-out evaluation samples the policy
        self.reward = reward  # its tally counts the grader's hack flags
        # A scheduled TAID t (a TAIDScheduler, not a fixed t): folded in from the logged
        # SDPO loss.
        self.taid = taid_t if isinstance(taid_t, TAIDScheduler) else None

    def on_log(self, state: Any, control: Any, logs: dict[str, Any]) -> None:
        if "reward" not in logs:  # the end-of-training summary row
            return
        step = int(state.global_step)
        row = {**logs, "step": step, "reward/mean": logs["reward"]}
        if self.taid is not None:
            row["taid/t"] = self.taid.t
            if logs.get("loss/jsd") is not None:
                self.taid.update_t(float(logs["loss/jsd"]), step)
        if self.reward is not None:
            row.update(self.reward.drain_tally())
        if self.life.close_step_if_out_of_time(step):
            control.should_training_stop = True
        if self.life.hack_round(step, row):
            control.should_training_stop = True
        if self.life.is_eval_step(step):
            heldout = self.life.evaluate(self.sampler, self.tokenizer, self.heldout, step=step)
            kl = self.kl_to_initial()
            if self.life.guard_round(step, row, heldout, kl_to_init=kl):
                control.should_training_stop = True
        self.life.append(row)

    def kl_to_initial(self) -> float | None:
        """Token-mean KL(policy || initial) on the last trained rollouts, every process's
        summed; None before anything was trained."""
        from composer_replication.integrations.altered_minds.kl_logging import token_mean_kl
        from composer_replication.training.setup import kl_to_initial_sum

        sampled = getattr(self.trainer, "last_sampled", None)
        if sampled is None or self.initial is None:
            return None
        config = self.life.config
        batches = sampled_micro_batches(
            sampled,
            max_tokens=config.micro_batch_tokens,
            pad_id=self.tokenizer.pad_token_id or 0,
        )
        was_training = self.policy.training
        self.policy.eval()
        try:
            total, count = kl_to_initial_sum(
                self.policy,
                self.initial,
                batches,
                config.loss.log_temperature,
                max_tokens=config.guard.kl_max_tokens,
            )
        finally:
            self.policy.train(was_training)
        ranks = self.life.ranks
        if ranks.distributed:
            parts = ranks.gather_shares([(total, count)], ranks.world_size)
            total, count = sum(t for t, _ in parts), sum(c for _, c in parts)
        return token_mean_kl(total, count)

    def as_trainer_callback(self) -> Any:
        from transformers import TrainerCallback

        owner = self

        class _Callback(TrainerCallback):
            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any):
                owner.on_log(state, control, dict(logs or {}))
                return control

        return _Callback()
