"""The run configuration (TOML), whose defaults ARE the embedded job.

``composer-replication train`` with no config trains SmolLM2-135M-Instruct (LoRA) on the
``python_functions`` environment with the ``composer`` algorithm. A TOML file overrides any
field; ``--set a.b.c=value`` overrides single fields on the command line.

Validation resolves what the environments' algorithms require of the shared settings, at
parse time and never silently:
- ``loss``: a loss setting an algorithm declares (``sdpo_jsd_beta``, ``replay_dpo_beta``,
  ``dpo_variant``) fills the run's value when the user left it unset; set explicitly to
  something else, it is an error naming both. ``loss.temperature`` follows the
  environments' ``sampling.temperature`` the same way.
- the jsd teacher model: one per run, owned by the algorithms (``advantage.teacher``);
  environments that ask for different ones are an error.
The run-level spellings ``jsd_teacher`` / ``ema_decay`` / ``pairs_file`` are deprecated: they
fold into every algorithm that has the setting, with a warning. A run-level ``[advantage]``
table and an environment's ``advantage = {...}`` are write-only shorthands for
``envs[i].algorithm.advantage`` (see :mod:`.shorthands`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from composer_replication.config.advantage import ComposerAdvantage
from composer_replication.config.algorithm import AlgorithmConfig, SamplingConfig
from composer_replication.config.deprecation import fold_engine_table, fold_run_level_spellings
from composer_replication.config.diloco import DiLoCoConfig
from composer_replication.config.evaluation_only import (
    EVALUATION_ONLY_ENVIRONMENTS as EVALUATION_ONLY_ENVIRONMENTS,
)
from composer_replication.config.evaluation_only import check_trainable_environment
from composer_replication.config.filters import FiltersConfig
from composer_replication.config.inference import InferenceConfig, InProcessInferenceConfig
from composer_replication.config.loss import LossConfig
from composer_replication.config.placement import check_device_spec, check_dtype_spec
from composer_replication.config.references import REFERENCE_SOLUTIONS
from composer_replication.config.roles import InProcessRoles, RolesConfig
from composer_replication.config.sandbox import SANDBOX_ENVIRONMENTS, DockerSandboxConfig
from composer_replication.config.shorthands import (
    SHORTHAND,
    fold_env_advantage,
    fold_run_advantage,
)

#: Components whose weight an algorithm owns, and the advantage field that holds it.
CHANNEL_WEIGHTS = {"jsd": "alpha_sdpo", "dpo": "beta_replay"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class LoraConfig(_Strict):
    """LoRA adapters (peft); the merged model is what gets saved at the end."""

    r: int = Field(16, ge=1, description="Adapter rank.")
    alpha: int = Field(32, ge=1, description="Adapter scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input.")
    target_modules: list[str] = Field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        description="Module names that get adapters.",
    )


class ModelConfig(_Strict):
    """Which policy to train and how."""

    source: str = Field(
        "embedded", description="'embedded', a local HF directory, a .gguf file or a cached hub id."
    )
    device: str = Field(
        "auto",
        description="Where the policy lives: 'auto' (a GPU when one is visible, else the CPU), "
        "'cpu', 'cuda' (under torchrun: the rank's LOCAL_RANK GPU) or 'cuda:N'.",
    )
    dtype: str = Field(
        "auto",
        description="'auto': float32 master parameters with bfloat16 autocast on a GPU that "
        "supports it or a CPU with bfloat16 instructions (AMX, AVX512-BF16), float32 on other "
        "CPUs; or a parameter dtype (float32, bfloat16, ...; 'float32' turns autocast off).",
    )
    lora: LoraConfig | None = Field(
        default_factory=LoraConfig,
        description="LoRA settings; null or false = full fine-tune, true = the defaults.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward (less memory, more time)."
    )
    tf32: bool = Field(
        True,
        description="On a CUDA device, let float32 matmuls and convolutions use TF32 tensor "
        "cores (torch.backends.cuda.matmul.allow_tf32 and cudnn.allow_tf32: 10-bit-mantissa "
        "inputs, float32 accumulation); false keeps them full float32. No effect on a CPU.",
    )

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_switch(cls, value: Any) -> Any:
        # TOML has no null: `lora = false` is a full fine-tune, `lora = true` the defaults
        if value is False:
            return None
        return {} if value is True else value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        return check_device_spec(value)

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        return check_dtype_spec(value)


class OptimConfig(_Strict):
    """AdamW with warm-up and a schedule, plus gradient clipping."""

    lr: float = Field(3e-4, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "linear", description="Decay after warm-up (linear: to zero at step `steps`)."
    )
    grad_clip: float | None = Field(
        1.0, gt=0, description="Max global gradient norm (null: no clipping)."
    )

    @field_validator("betas")
    @classmethod
    def _betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        # AdamW's moment decays: outside [0, 1) the moments grow without bound
        if not all(0 <= b < 1 for b in value):
            raise ValueError("each beta must be in [0, 1), e.g. [0.9, 0.99]")
        return value


class EnvConfig(_Strict):
    """One environment and the algorithm that trains on it."""

    name: str = Field(
        "python_functions",
        description="Environment: python_functions, feature_deletion, or an import path 'pkg.mod:factory'.",
    )
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig, description="Sampling + advantage settings."
    )
    tasks_per_step: int = Field(
        4,
        ge=1,
        le=1_000_000,
        description="Tasks sampled per step (each gets sampling.group_size rollouts).",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Environment-specific options (task file, difficulty filter, ...).",
    )
    sandbox: Literal["local", "docker"] = Field(
        "local",
        description="Where candidate code runs: 'local' (a host subprocess sandbox, under "
        "bubblewrap when available) or 'docker' (one locked-down container per attempt; set "
        "the [envs.docker] table). Built-in environments only.",
    )
    docker: DockerSandboxConfig | None = Field(
        None, description="Docker backend settings: required with sandbox = 'docker', only then."
    )
    first_step: int = Field(
        1,
        ge=1,
        description="The first step (1-based) this entry samples on; with last_step, an entry "
        "can imitate demonstrations first and hand over to rl (a warm start in one run).",
    )
    last_step: int | None = Field(
        None, ge=1, description="The last step this entry samples on (null: to the end)."
    )

    def active_at(self, step: int) -> bool:
        """Whether this entry samples on step ``step`` (1-based)."""
        return self.first_step <= step and (self.last_step is None or step <= self.last_step)

    @model_validator(mode="before")
    @classmethod
    def _advantage_shorthand(cls, data: Any) -> Any:
        # `advantage = {...}` on the entry is write-only: it folds into algorithm.advantage
        return fold_env_advantage(data)

    @model_validator(mode="after")
    def _trainable(self) -> EnvConfig:
        check_trainable_environment(self.name)
        return self

    @model_validator(mode="after")
    def _sandbox_backend(self) -> EnvConfig:
        if self.sandbox == "docker":
            if self.name not in SANDBOX_ENVIRONMENTS:
                raise ValueError(
                    f"environment {self.name!r}: sandbox = 'docker' applies to the built-in "
                    f"environments {', '.join(SANDBOX_ENVIRONMENTS)}; an environment factory "
                    "builds its own sandboxes (give it a backend through options), so leave "
                    "sandbox = 'local' here"
                )
            if self.docker is None:
                raise ValueError(
                    f"environment {self.name!r}: sandbox = 'docker' needs an [envs.docker] "
                    "table naming the image, e.g. docker = { image = 'python:3.11-slim' }"
                )
        elif self.docker is not None:
            raise ValueError(
                f"environment {self.name!r}: an [envs.docker] table is set but sandbox = "
                f"{self.sandbox!r}; set sandbox = 'docker' to use it, or remove the table"
            )
        return self

    @model_validator(mode="after")
    def _steps(self) -> EnvConfig:
        if self.last_step is not None and self.last_step < self.first_step:
            raise ValueError(
                f"environment {self.name!r}: last_step = {self.last_step} is before "
                f"first_step = {self.first_step}; the entry would never sample"
            )
        return self

    @model_validator(mode="after")
    def _algorithm_fits_environment(self) -> EnvConfig:
        self.algorithm.advantage.check_environment(self.name)
        return self


def _default_envs() -> list[EnvConfig]:
    return [
        EnvConfig(
            name="python_functions",
            algorithm=AlgorithmConfig(
                sampling=SamplingConfig(group_size=4, temperature=0.7, max_new_tokens=80),
                advantage=ComposerAdvantage(),
            ),
            tasks_per_step=2,
        )
    ]


def _default_env_data(*, with_advantage: bool = True) -> list[dict[str, Any]]:
    """The default environment list as raw config data (what a user would write out);
    without its advantage where a run-level ``[advantage]`` table replaces it."""
    envs = [env.model_dump(mode="json") for env in _default_envs()]
    if not with_advantage:
        for env in envs:
            env["algorithm"].pop(SHORTHAND)
    return envs


class EvalConfig(_Strict):
    """Held-out evaluation (pass@1, pass@k, greedy pass@1) and when to run it.

    The default pass@1 is the mean success of ``samples_per_task`` answers sampled at
    temperature 1 (the usual RL-for-code estimate, e.g. arXiv 2501.12948; ``temperature``
    sets another, whatever the training samples at), drawn
    with the same ``seed`` at every evaluation so that before/after differences are not
    sampling noise; ``temperature = 0`` gives greedy pass@1 instead. The same samples give
    ``heldout/pass@k`` for the other k of ``reported_ks(samples_per_task)`` (1, 5, 10 up to
    ``samples_per_task``, and ``samples_per_task`` itself) by the unbiased estimator of
    arXiv 2107.03374. ``greedy = true`` (the default) adds ``heldout/greedy_pass@1``: one
    temperature-0 answer per task, at the cost of one more generation pass per evaluation;
    it is the number a user's own use of the model (greedy decoding) sees.
    """

    every: int = Field(
        10,
        ge=1,
        description="Evaluate every N steps (and feed the kill switch); the last step "
        "is always evaluated.",
    )
    at_start: bool = Field(True, description="Evaluate the initial policy before training.")
    reuse_start: bool = Field(
        True,
        description="Reuse the start evaluation of a run that started from the same weights "
        "with the same held-out tasks, evaluation settings and code (kept in the project's "
        "cache; single-process runs): the same numbers without sampling them again.",
    )
    samples_per_task: int = Field(
        4, ge=1, le=1_000_000, description="Samples per held-out task for pass@1."
    )
    temperature: float = Field(
        1.0, ge=0, description="Sampling temperature for evaluation (0 = greedy)."
    )
    max_tasks: int | None = Field(
        None, ge=1, description="Cap on held-out tasks per evaluation (null: all)."
    )
    seed: int = Field(
        0, description="Seed of evaluation sampling (training's random streams are untouched)."
    )
    greedy: bool = Field(
        True,
        description="Also report greedy pass@1 (heldout/greedy_pass@1): one more generation "
        "pass per evaluation, at temperature 0 (false saves that pass).",
    )
    sampling_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Precision of the matrix products while the policy in this process "
        "samples held-out answers: 'auto' is float32 on a CPU (the instrument stays the same "
        "whatever the learner computes in) and [inference] sampling_dtype's on a GPU; "
        "'float32'; 'bfloat16' (on a CPU it needs bfloat16 instructions).",
    )


class GuardConfig(_Strict):
    """The HeldOutGuard kill switch (see ``composer_replication.safety``)."""

    enabled: bool = True
    # The same ranges as HeldOutGuard: finite numbers only (NaN / inf would switch a gate off).
    kl_hard_stop: float = Field(
        0.08,
        gt=0,
        allow_inf_nan=False,
        description="Token-mean KL to the initial policy (nats/token) that stops the run.",
    )
    kl_max_tokens: int | None = Field(
        4096,
        ge=1,
        description="Tokens of the last step's micro-batches that the KL to the initial "
        "policy is measured on at each evaluation, at most: whole micro-batches evenly "
        "spread over the step's (at least one); null: all of them. Each measured token "
        "costs a forward of the policy and one of the initial model.",
    )
    max_proxy_real_gap: float = Field(
        0.10,
        allow_inf_nan=False,
        description="In-loop gain minus held-out gain that stops the run (any finite number; "
        "0 or less fires on any unmatched proxy gain).",
    )
    min_steps: int = Field(
        20, description="Evaluations before any tripwire may fire (<= 1: from the first one)."
    )
    decline_patience: int = Field(
        3, ge=1, description="Consecutive held-out declines under a rising proxy that stop the run."
    )
    ema_alpha: float = Field(0.9, ge=0, lt=1, description="EMA weight on the prior value.")
    rise_eps: float = Field(
        1e-4,
        allow_inf_nan=False,
        description="Largest EMA move that still counts as flat (any finite number; negative: "
        "a flat EMA counts as both rising and declining, so the guard fires sooner).",
    )
    hack_fraction_stop: float | None = Field(
        0.25,
        gt=0,
        le=1,
        description="Share of a step's rollouts with hack flags (what they did outside their "
        "answer) that, for hack_patience steps in a row, stops the run; null: off.",
    )
    hack_patience: int = Field(
        3, ge=1, description="Consecutive steps over hack_fraction_stop that stop the run."
    )
    non_finite: Literal["stop", "skip"] = Field(
        "stop",
        description="A step whose loss, a loss component or the gradient norm is NaN or "
        "infinite never updates the weights; 'stop' ends the run there (exit code 3, the "
        "component named), 'skip' drops that step's update and goes on (counted in "
        "guard/non_finite_skipped). With the guard disabled such steps are skipped.",
    )

    def guard_kwargs(self) -> dict[str, Any]:
        """The ``HeldOutGuard`` settings (the hack tripwire and the numeric guard are the run
        lifecycle's)."""
        return self.model_dump(
            exclude={
                "enabled",
                "hack_fraction_stop",
                "hack_patience",
                "kl_max_tokens",
                "non_finite",
            }
        )


class CheckpointConfig(_Strict):
    """Atomic checkpoints for --resume."""

    every: int = Field(5, ge=1, description="Checkpoint every N steps.")
    keep_last: int = Field(2, ge=1, description="How many checkpoints to keep.")


#: the most steps a run may ask for (a bound checked before anything loops over them)
MAX_STEPS = 10**9


def _idle_steps(steps: int, spans: list[tuple[int, int | None]], most: int = 6) -> list[int]:
    """The first ``most`` steps of ``1..steps`` no span ``(first, last)`` covers (``last``
    None: to the end), found from the spans' ends, never by walking every step."""
    intervals = sorted(
        (first, steps if last is None else min(last, steps)) for first, last in spans
    )
    idle: list[int] = []
    covered = 0  # every step up to here is covered
    for first, last in [*intervals, (steps + 1, steps + 1)]:
        gap = range(covered + 1, min(first, steps + 1))
        idle.extend(gap[: most - len(idle)])
        covered = max(covered, last)
        if covered >= steps or len(idle) >= most:
            break
    return idle


class RunConfig(_Strict):
    """Everything a training run needs. Defaults = the embedded CPU job."""

    seed: int = Field(0, description="Seed for Python, NumPy and torch.")
    steps: int = Field(10, ge=1, le=MAX_STEPS, description="Optimizer steps.")
    max_wall_seconds: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Time budget: the first step that ends this many seconds into the run "
        "(the summary's wall_time_s clock, initial evaluation included) is the last one; the "
        "run then evaluates, saves and finishes as at step `steps`. The LR schedule still "
        "spans `steps`. null: run every step.",
    )
    output_dir: str = Field(
        "runs/default", description="Checkpoints, metrics, report and the final model go here."
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    envs: list[EnvConfig] = Field(
        default_factory=_default_envs, description="Environments, each with its own algorithm."
    )
    filters: FiltersConfig = Field(
        default_factory=FiltersConfig,
        description="What leaves a step's batch before packing (zero-advantage groups).",
    )
    optim: OptimConfig = Field(default_factory=OptimConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    jsd_teacher: Literal["policy", "initial", "ema"] | None = Field(
        None,
        description="Deprecated: write advantage.teacher in the sdpo / composer algorithms.",
    )
    ema_decay: float | None = Field(
        None, ge=0, lt=1, description="Deprecated: write advantage.ema_decay."
    )
    micro_batch_tokens: int = Field(
        1024,
        ge=1,
        description="Padded tokens per micro-batch (activation memory grows with it; on a "
        "CPU, 1024 keeps the matmuls efficient).",
    )
    malloc_mmap_threshold: int | None = Field(
        None,
        ge=0,
        le=32 * 1024 * 1024,
        description="glibc mmap threshold in bytes, fixed at start so freed activation blocks "
        "return to the system (see cpu_allocator): lower peak RSS, but every large "
        "allocation then page-faults afresh (slower steps); null keeps glibc's dynamic one.",
    )
    malloc_trim_every_s: float | None = Field(
        3.0,
        gt=0,
        description="A CPU run hands the heap's free pages back to the system every this many "
        "seconds (glibc's malloc_trim, from a background thread), so that its resident "
        "memory follows its tensors inside a phase too (see cpu_allocator); null: only "
        "between phases.",
    )
    heldout_fraction: float = Field(
        0.25, gt=0, lt=1, description="Share of tasks held out for evaluation (never trained on)."
    )
    heldout_salt: str = Field("composer-replication", description="Salt of the held-out hash.")
    pairs_file: str | None = Field(
        None, description="Deprecated: write advantage.pairs_path in replay_dpo / composer."
    )
    eval: EvalConfig = Field(default_factory=EvalConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    diloco: DiLoCoConfig = Field(
        default_factory=DiLoCoConfig,
        description="DiLoCo outer loop across replicas (off by default).",
    )
    roles: RolesConfig = Field(
        default_factory=InProcessRoles,
        description="Where the roles run (placement): in_process (the native loop) or monarch "
        "(actors on a Monarch process mesh). Formerly [engine] type.",
    )
    inference: InferenceConfig = Field(
        default_factory=InProcessInferenceConfig,
        description="Who samples the policy's rollouts: in process (default) or a vLLM server.",
    )
    trackers: list[Literal["tensorboard", "wandb", "trackio"]] = Field(
        default_factory=list, description="Optional experiment trackers."
    )
    save_rollouts: Literal["none", "eval", "all"] = Field(
        "eval",
        description="Rollouts written as JSONL under <run>/rollouts/: none, the held-out "
        "evaluations' (eval_step_<step>.jsonl), or those and every training step's "
        "(train_step_<step>.jsonl).",
    )

    @model_validator(mode="before")
    @classmethod
    def _advantage_shorthand(cls, data: Any) -> Any:
        # a run-level [advantage] table is write-only: it becomes the advantage of every
        # environment that gives none of its own (see config.shorthands)
        return fold_run_advantage(data, lambda: _default_env_data(with_advantage=False))

    @model_validator(mode="before")
    @classmethod
    def _old_engine_table(cls, data: Any) -> Any:
        # [engine] type = X is the old spelling of [roles] placement = X
        return fold_engine_table(data)

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        # one environment may feed several entries (a demonstration entry beside an rl one),
        # but two identical entries are one entry with twice the tasks
        entries = [e.model_dump_json() for e in self.envs]
        repeated = sorted({e.name for e, j in zip(self.envs, entries) if entries.count(j) > 1})
        if repeated:
            raise ValueError(
                f"envs repeats an identical entry for {repeated}: merge them into one entry "
                "(raise its tasks_per_step), or give them different algorithms or options"
            )
        if not self.envs:
            raise ValueError("envs is empty: configure at least one environment")
        idle = _idle_steps(self.steps, [(e.first_step, e.last_step) for e in self.envs])
        if idle:
            shown = ", ".join(map(str, idle[:5])) + (", ..." if len(idle) > 5 else "")
            raise ValueError(
                f"no environment entry samples on step {shown} of {self.steps}: change the "
                "entries' first_step / last_step so that every step has one"
            )
        fold_run_level_spellings(self)
        self._resolve_loss()
        self._one_weight_per_channel()
        self.teacher_mode  # noqa: B018 - validates that the environments agree
        return self

    def _one_weight_per_channel(self) -> None:
        """The SDPO and replay-DPO terms have one owner of their weight, the algorithm
        (``alpha_sdpo``, ``beta_replay``): a loss coefficient on the same component would
        scale them a second time, so it must stay 1 where an algorithm owns the weight."""
        for component, field in CHANNEL_WEIGHTS.items():
            coefficient = self.loss.coefficients.get(component, 1.0)
            if coefficient == 1.0:
                continue
            for i, env in enumerate(self.envs):
                weight = getattr(env.algorithm.advantage, field, None)
                if weight is not None:
                    raise ValueError(
                        f"loss.coefficients.{component} = {coefficient!r} would scale the "
                        f"term a second time: its weight is envs.{i}.algorithm.advantage."
                        f"{field} ({weight!r}); set it there and leave "
                        f"loss.coefficients.{component} at 1"
                    )

    def _resolve_loss(self) -> None:
        """Fill the loss settings the algorithms require; explicit conflicts are errors."""
        required: dict[str, tuple[Any, str]] = {}
        # reference solutions are not sampled: their entry's temperature means nothing
        sampled = [e for e in self.envs if e.algorithm.sampling.source != REFERENCE_SOLUTIONS]
        temperatures = {e.algorithm.sampling.temperature for e in sampled or self.envs}
        if len(temperatures) > 1:
            raise ValueError(
                f"environments sample at different temperatures {sorted(temperatures)}; the "
                "trainer recomputes log-probs at one temperature: use one sampling.temperature"
            )
        required["temperature"] = (temperatures.pop(), "envs.*.algorithm.sampling.temperature")
        for i, env in enumerate(self.envs):
            for key, value in env.algorithm.advantage.loss_requirements().items():
                where = f"envs.{i}.algorithm.advantage.{key}"
                if key in required and required[key][0] != value:
                    raise ValueError(
                        f"{required[key][1]} = {required[key][0]!r} and {where} = {value!r} "
                        f"need different loss.{key}; set them equal"
                    )
                required[key] = (value, where)
        explicit = self.loss.model_fields_set
        updates = {}
        for key, (value, where) in required.items():
            current = getattr(self.loss, key)
            if key in explicit and current is not None and current != value:
                raise ValueError(
                    f"loss.{key} = {current!r} contradicts {where} = {value!r}, which the "
                    f"algorithm needs; remove one of them or set them equal"
                )
            updates[key] = value
        self.loss = self.loss.model_copy(update=updates)
        self.loss.model_fields_set.update(updates)

    @property
    def teacher_mode(self) -> tuple[str, float]:
        """``(mode, ema_decay)`` of the run's jsd teacher model (one per run)."""
        wanted = {
            (i, env.algorithm.advantage.teacher_mode)
            for i, env in enumerate(self.envs)
            if env.algorithm.advantage.teacher_mode is not None
        }
        modes = {mode for _, mode in wanted}
        if len(modes) > 1:
            listed = ", ".join(f"envs.{i}: {m}" for i, m in sorted(wanted))
            raise ValueError(
                f"environments ask for different jsd teachers ({listed}); one run has one "
                "teacher model: set advantage.teacher / ema_decay equal"
            )
        return modes.pop() if modes else ("policy", 0.99)

    @classmethod
    def from_toml(cls, source: str | Path, overrides: list[str] | None = None) -> RunConfig:
        """Load a TOML file (or text), then apply ``a.b.c=value`` overrides.

        Relative input paths in a file (pairs, task files, a model directory) are relative
        to the file (see ``_resolve_paths``); ``output_dir`` and overrides are relative to
        the working directory.
        """
        is_text = isinstance(source, str) and ("\n" in source or "=" in source)
        path = Path(source)
        if not is_text:
            if not path.exists():
                raise FileNotFoundError(f"config file {path} does not exist")
            if not path.is_file():
                raise IsADirectoryError(f"config file {path} is not a file; pass a run TOML")
            try:
                data = tomllib.loads(path.read_text(encoding="utf-8"))
            except UnicodeDecodeError:
                raise ValueError(
                    f"config file {path} is not text (not UTF-8); pass a run TOML"
                ) from None
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"config file {path} is not valid TOML: {exc}") from None
        else:
            data = tomllib.loads(str(source))
        if not is_text:
            _resolve_paths(data, path.resolve().parent)
        _apply_overrides(data, overrides or [])  # values stay relative to the shell
        return cls.model_validate(data)

    @classmethod
    def default(cls, overrides: list[str] | None = None) -> RunConfig:
        data: dict[str, Any] = {}
        _apply_overrides(data, overrides or [])
        return cls.model_validate(data)


# Input files a config names: relative to the config file, so it runs from any directory.
_FILE_KEYS = frozenset({"pairs_path", "pairs_file", "task_file"})
# Locations that may also be names: relative to the config file when that path exists
# (else a hub id, or a shipped repository's name).
_LOCATION_KEYS = frozenset({"source", "local_path", "repo"})


def _resolve_paths(node: Any, base: Path, key: str = "") -> Any:
    """Rewrite, in place, the relative input paths of a config file's data as paths
    relative to ``base`` (the config's folder): ``pairs_path``, ``pairs_file``,
    ``task_file`` and options ending in ``_file`` / ``_path``; a model ``source`` or
    ``local_path``, or a repository (``repo``), when such a file or folder exists. ``output_dir`` is left as written
    (where a run writes is the caller's working directory)."""
    if isinstance(node, dict):
        for k, v in node.items():
            node[k] = _resolve_paths(v, base, str(k))
        return node
    if isinstance(node, list):
        return [_resolve_paths(v, base, key) for v in node]
    if not isinstance(node, str) or not node or Path(node).expanduser().is_absolute():
        return node
    if node.startswith("~"):
        return node
    candidate = Path(os.path.normpath(base / node))
    if key in _LOCATION_KEYS:
        if node == "embedded" or candidate.exists():
            return node if node == "embedded" else str(candidate)
        if Path(node).expanduser().exists():  # the working directory's: never taken silently
            raise ValueError(
                f"{key} = {node!r}: a path in a config file is relative to the file's folder, "
                f"and {candidate} does not exist (it does relative to the working directory); "
                f"write it relative to {base} or as an absolute path"
            )
        return node
    if key in _FILE_KEYS or (key.endswith(("_file", "_path")) and key != "import_path"):
        return str(candidate)
    return node


def _apply_overrides(data: dict[str, Any], items: list[str]) -> None:
    """Apply ``a.b.c=value`` overrides in order. An override inside an ``envs`` list the
    data does not have spells out the default environments first; an ``advantage``
    shorthand override then replaces their default advantage."""
    spelled_defaults = "envs" not in data
    for item in items:
        _apply_override(data, item, spelled_defaults=spelled_defaults)


def _apply_override(data: dict[str, Any], item: str, *, spelled_defaults: bool = False) -> None:
    if "=" not in item:
        raise ValueError(f"override {item!r} must look like a.b.c=value")
    key, raw = item.split("=", 1)
    if not key.strip() or any(not part for part in key.strip().split(".")):
        raise ValueError(f"override {item!r} names no field; write a.b.c=value, e.g. steps=4")
    parts = key.strip().split(".")
    if parts[0] == "envs" and "envs" not in data:
        # An override inside the default environment list: spell the defaults out first
        # (without their advantage when a run-level [advantage] table replaces it).
        data["envs"] = _default_env_data(with_advantage=SHORTHAND not in data)
    if "*" in parts:  # each entry of a list: envs.*.options.repo=... sets every entry's
        star = parts.index("*")
        entries = _node_at(data, parts[:star])
        if not isinstance(entries, list) or not entries:
            raise ValueError(
                f"override {item!r}: {'.'.join(parts[:star]) or 'the config'} is not a list "
                "with entries ('*' stands for each entry of a list, e.g. envs.*.options.repo)"
            )
        for index in range(len(entries)):
            each = ".".join([*parts[:star], str(index), *parts[star + 1 :]])
            _apply_override(data, f"{each}={raw}", spelled_defaults=spelled_defaults)
        return
    shorthand = parts[0] == SHORTHAND or (parts[0] == "envs" and parts[2:3] == [SHORTHAND])
    if shorthand and spelled_defaults and isinstance(data.get("envs"), list):
        _unspell_default_advantages(data, parts)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw  # a bare string
    node = data
    for part in parts[:-1]:
        if part.isdigit() and isinstance(node, list):
            if int(part) >= len(node):
                raise ValueError(
                    f"override {item!r}: index {part} is out of range (the list has "
                    f"{len(node)} entries)"
                )
            node = node[int(part)]
            continue
        node = node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            raise ValueError(f"override {item!r}: {part} is not a table")
    last = parts[-1]
    if isinstance(node, list) and last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value


def _node_at(data: Any, parts: list[str]) -> Any:
    """What ``parts`` (table keys, list indices) lead to in ``data``; None where nothing is."""
    node = data
    for part in parts:
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict):
            node = node.get(part)
        else:
            return None
    return node


def _unspell_default_advantages(data: dict[str, Any], parts: list[str]) -> None:
    """Before an ``advantage`` shorthand override (run level, or ``envs.N.advantage``):
    drop the default advantage that spelling out the default environments wrote, so the
    shorthand replaces it instead of contradicting it (one an override changed stays)."""
    defaults = _default_env_data()
    if parts[0] == "envs":
        indices = [int(parts[1])] if parts[1].isdigit() else []
    else:
        indices = list(range(len(data["envs"])))
    for i in indices:
        if i >= min(len(defaults), len(data["envs"])):
            continue
        env = data["envs"][i]
        algorithm = env.get("algorithm") if isinstance(env, dict) else None
        if (
            isinstance(algorithm, dict)
            and algorithm.get(SHORTHAND) == defaults[i]["algorithm"][SHORTHAND]
        ):
            algorithm.pop(SHORTHAND)
