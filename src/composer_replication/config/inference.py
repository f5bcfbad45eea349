"""The ``[inference]`` section: who samples the policy's rollouts.

``engine = "in_process"`` (the default) samples with the live policy in the training
process, with the decode loop its own fields choose. ``engine = "vllm"`` samples through a
vLLM OpenAI-compatible server: started by the run on loopback from the engine's own
virtualenv (``python``) or a ``command``, or one already running at ``url``. After every
optimizer step the trainer writes the policy's weights once and the engine reloads them in
place (a versioned sync).

``engine = "package.module:factory"`` is a user's engine: ``factory(config, *, policy,
model_source, run_dir, seed, sample_ahead, autocast)`` returns an object with the
``roles.InferenceEngine`` methods, and ``options`` holds its own settings.

The section is a union keyed on ``engine``: the settings all share (how far to sample
ahead) sit in a base, each engine's own settings only on its config, and a setting given
for another engine is refused naming the engine it belongs to.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from composer_replication.config.advantage import IMPORT_PATH_PATTERN

__all__ = [
    "DEFAULT_ENGINE_PYTHON",
    "INFERENCE_ENGINES",
    "InProcessInferenceConfig",
    "InferenceConfig",
    "UserInferenceConfig",
    "VllmInferenceConfig",
    "inference_config",
]

DEFAULT_ENGINE_PYTHON = ".venv-vllm/bin/python"


class _SharedInferenceConfig(BaseModel):
    """The settings of every engine: how far sampling runs ahead of training."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    async_level: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto",
        description="Steps sampled ahead of training: 0 samples each step's rollouts before "
        "training on them; k > 0 samples the next k steps' rollouts while the trainer runs "
        "(in process: from a copy of the weights refreshed after each optimizer step, on its "
        "own CUDA stream), so a step trains on rollouts of the policy k versions older; "
        "'auto': 1 on a GPU, 0 on a CPU (where sampling and training share the cores).",
    )
    max_off_policy_steps: int = Field(
        8,
        ge=0,
        description="Rollouts sampled more than this many policy versions before the weights "
        "that train on them are dropped (and counted in rollouts/stale_dropped).",
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_other_engines_fields(cls, data: Any) -> Any:
        # a setting of the other engine would be ignored silently: say whose it is
        if not isinstance(data, dict):
            return data
        own = cls.model_fields
        for name, config in INFERENCE_ENGINES.items():
            if config is cls:
                continue
            for key in data:
                if key not in own and key in config.model_fields:
                    engine = data.get("engine", "in_process")
                    raise ValueError(
                        f"inference.{key} is a setting of engine = {name!r}, not of "
                        f"engine = {engine!r}: set inference.engine = {name!r} or remove {key}"
                    )
        return data

    @model_validator(mode="after")
    def _check_lag(self) -> Any:
        if self.async_level != "auto" and self.async_level > self.max_off_policy_steps:
            raise ValueError(
                f"inference.async_level={self.async_level} > max_off_policy_steps="
                f"{self.max_off_policy_steps}: every batch would be dropped as too old; raise "
                "max_off_policy_steps to at least async_level"
            )
        return self

    def resolved_async_level(self, device_type: str, *, distributed: bool = False) -> int:
        """The steps to sample ahead for a policy on ``device_type`` ('auto' resolved: 1 on a
        GPU, 0 on a CPU; 0 under several in-process ranks, whose sampling is collective).

        Raises ``ValueError`` for an explicit level the in-process engine cannot run: under
        torchrun the ranks' sharded weights are gathered for sampling, a collective that
        cannot run beside the training step's."""
        if self.async_level == "auto":
            if device_type == "cpu" or (distributed and self.engine == "in_process"):
                return 0
            return min(1, self.max_off_policy_steps)
        if self.async_level and distributed and self.engine == "in_process":
            raise ValueError(
                f"inference.async_level={self.async_level} with the in-process engine runs in "
                "one process only; under torchrun set async_level = 0 or engine = 'vllm'"
            )
        return self.async_level


class InProcessInferenceConfig(_SharedInferenceConfig):
    """The live policy samples in the training process, with these decode settings."""

    engine: Literal["in_process"] = Field(
        "in_process",
        description="'in_process': the live policy samples in the training process; 'vllm': "
        "a vLLM server samples and receives the weights after each optimizer step.",
    )
    decode_loop: Literal["auto", "static", "general"] = Field(
        "auto",
        description="In-process decode loop: 'static' keeps the batch on the device (static "
        "KV cache, device-side sampling, one host read every sync_every tokens, a CUDA graph "
        "per step on a GPU); 'general' is the host-driven loop with prompt-lookup drafts and "
        "rows joining as others finish (fastest on a CPU); 'auto' picks static on a GPU for "
        "a Llama-family model, general otherwise.",
    )
    sync_every: int = Field(
        16,
        ge=1,
        le=1024,
        description="Static decode loop: decode steps between two host reads of the batch "
        "(finished rows are found and trimmed then).",
    )
    compile_decode: bool = Field(
        False,
        description="Static decode loop: compile the decode step with torch.compile (fused "
        "kernels; the first call of each shape compiles, tens of seconds on a GPU).",
    )
    cuda_graphs: bool = Field(
        True,
        description="Static decode loop on a GPU: replay each decode step as a captured CUDA "
        "graph (one launch per token instead of one per operator).",
    )
    sampling_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Precision of the matrix products while sampling rollouts, independent "
        "of the learner's: 'auto' follows the learner's autocast (bfloat16 on a GPU and on "
        "a CPU that computes it, float32 otherwise); 'float32'; 'bfloat16' (a bfloat16 copy "
        "of the weights made once per sampling call; on a CPU it needs bfloat16 "
        "instructions). The sampler's log-probs are what the loss's importance ratio "
        "compares against. Held-out answers have their own: [eval] sampling_dtype.",
    )


class VllmInferenceConfig(_SharedInferenceConfig):
    """A vLLM server samples; the trainer syncs the policy's weights to it after each step."""

    engine: Literal["vllm"] = Field(
        "vllm",
        description="'vllm': a vLLM server samples and receives the weights after each "
        "optimizer step.",
    )
    python: str = Field(
        DEFAULT_ENGINE_PYTHON,
        description="Python executable of the engine's virtualenv (built by `make vllm-env`); "
        "the server runs as `<python> -m vllm.entrypoints.openai.api_server`.",
    )
    command: list[str] | None = Field(
        None,
        description="Full command that starts the server instead of `python` (the manager "
        "still appends the model, host, port and engine flags).",
    )
    url: str | None = Field(
        None,
        description="Base URL (e.g. http://127.0.0.1:8000) of a server already running; when "
        "set nothing is started and the server must have been started with the weight-sync "
        "worker extension and VLLM_SERVER_DEV_MODE=1.",
    )
    port: int = Field(
        0, ge=0, le=65535, description="Loopback port of the started server; 0 picks a free one."
    )
    kv_cache_gib: float = Field(
        1.0, gt=0, description="CPU KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."
    )
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="Fraction of accelerator memory for the engine (GPU builds)."
    )
    max_model_len: int = Field(
        2048, ge=16, description="Longest prompt + completion the engine accepts, in tokens."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Engine weight dtype; float32 matches the CPU trainer's log-probs exactly.",
    )
    optimization_level: int = Field(
        2,
        ge=0,
        le=3,
        description="The engine's -O level: 0 starts at once without compiling (eager "
        "kernels); 1-3 compile the model first (about a minute on 2 CPU cores), faster "
        "decoding after.",
    )
    startup_timeout_s: float = Field(
        300.0, gt=0, description="Seconds to wait for the server's /health before giving up."
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="Seconds one sampling request may take."
    )
    weights_dir: str | None = Field(
        None,
        description="Where synced weights are written (one safetensors file per version, "
        "the previous one removed); default <output_dir>/engine_weights.",
    )
    lora_sync: Literal["merged", "adapter"] = Field(
        "merged",
        description="How a LoRA policy reaches the engine: 'merged' writes the full weights "
        "with the adapters folded in (any engine); 'adapter' writes only the adapter and "
        "loads it with /v1/load_lora_adapter (the server runs with --enable-lora). A full "
        "fine-tune always writes the full weights.",
    )
    max_lora_rank: int = Field(
        16,
        ge=1,
        le=512,
        description="With lora_sync = 'adapter': the largest adapter rank the engine accepts "
        "(at least [model.lora] r).",
    )
    extra_args: list[str] = Field(
        default_factory=list, description="More server flags, appended as given."
    )
    serve_frozen: bool = Field(
        True,
        description="With engine = 'vllm': frozen models given by local_path (opd/opsd "
        "references, sft sources) are served by engine servers of their own; false loads "
        "them in the training process.",
    )

    @model_validator(mode="after")
    def _check_server(self) -> VllmInferenceConfig:
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(
                f"inference.url={self.url!r} must start with http:// or https:// "
                "(e.g. http://127.0.0.1:8000)"
            )
        if self.command is not None and not self.command:
            raise ValueError("inference.command is empty: give the argv or leave it unset")
        return self


class UserInferenceConfig(_SharedInferenceConfig):
    """A user's engine, named by import path: ``factory(config, *, policy, model_source,
    run_dir, seed, sample_ahead, autocast)`` returns a ``roles.InferenceEngine``."""

    engine: str = Field(
        ...,
        pattern=IMPORT_PATH_PATTERN,
        description="'package.module:factory' of the engine (called with this config and the "
        "run's policy; it returns an object with the roles.InferenceEngine methods).",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="The engine's own settings (the factory reads them)."
    )


#: what ``engine`` names -> its config (a user's engine: any 'package.module:factory')
INFERENCE_ENGINES: dict[str, type[_SharedInferenceConfig]] = {
    "in_process": InProcessInferenceConfig,
    "vllm": VllmInferenceConfig,
    "package.module:factory": UserInferenceConfig,
}


def _engine_of(data: Any) -> str:
    """The union's tag of a raw ``[inference]`` table or a config: the engine it names
    (in_process when unset), ``user`` for an import path."""
    if isinstance(data, dict):
        engine = str(data.get("engine", "in_process"))
    else:
        engine = str(getattr(data, "engine", "in_process"))
    return "user" if ":" in engine else engine


#: ``[inference]``: one of the engines' configs, chosen by its ``engine`` field
InferenceConfig = Annotated[
    Annotated[InProcessInferenceConfig, Tag("in_process")]
    | Annotated[VllmInferenceConfig, Tag("vllm")]
    | Annotated[UserInferenceConfig, Tag("user")],
    Discriminator(
        _engine_of,
        custom_error_type="inference_engine",
        custom_error_message="inference.engine must be 'in_process', 'vllm' or "
        "'package.module:factory' of a user's engine",
    ),
]


def inference_config(
    **fields: Any,
) -> InProcessInferenceConfig | VllmInferenceConfig | UserInferenceConfig:
    """The ``[inference]`` config of ``fields`` (``engine`` picks the class, in_process
    when unset), validated as a run config's would be."""
    from pydantic import TypeAdapter

    return TypeAdapter(InferenceConfig).validate_python(fields)
