"""The policy's inference engine for one run: the server, its sampler and the weight sync;
and :func:`build_inference_engine`, the engine a run's ``[inference]`` config names.

``PolicyEngine`` starts the server on first use (``sampler``), pushes the policy after
every optimizer step (``after_step``) and stops the server in ``stop`` / on leaving its
``with`` block. Policy version ``v`` is the policy after ``v`` optimizer steps; the engine
starts on version 0, the weights of ``[model] source``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_replication.inference.sampler import EngineSampler
from composer_replication.inference.server import EngineServer
from composer_replication.inference.weight_sync import WeightSync

if TYPE_CHECKING:
    from composer_replication.config.inference import InferenceConfig, VllmInferenceConfig
    from composer_replication.roles import InferenceEngine


def engine_model_dir(source: str) -> Path:
    """The plain Hugging Face directory the engine loads for a ``[model] source``."""
    if source == "embedded":
        from composer_replication.model.loading import embedded_model_dir

        return embedded_model_dir()
    path = Path(source).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(
        f"model.source={source!r}: the inference engine loads a plain Hugging Face directory "
        "(config.json + safetensors); use 'embedded' or such a directory, or "
        "inference.engine = 'in_process'"
    )


class PolicyEngine:
    """One run's engine: lazily started server, token-in/token-out sampler, weight sync."""

    def __init__(
        self,
        config: VllmInferenceConfig,
        *,
        model_dir: str | Path,
        run_dir: str | Path,
        seed: int | None = None,
    ) -> None:
        self.config = config
        run_dir = Path(run_dir)
        self.server = EngineServer(config, model_dir, log_path=run_dir / "engine.log")
        self.weights_dir = Path(config.weights_dir or run_dir / "engine_weights")
        self.seed = seed
        self._sampler: EngineSampler | None = None
        self._sync: WeightSync | None = None

    @property
    def started(self) -> bool:
        return self._sampler is not None

    @property
    def sampler(self) -> EngineSampler:
        """The sampler (starts the server on first use)."""
        if self._sampler is None:
            self.server.start()
            self._sampler = EngineSampler(
                self.server.base_url, timeout_s=self.config.request_timeout_s, seed=self.seed
            )
            self._sync = WeightSync(
                self.server.base_url,
                self.weights_dir,
                timeout_s=self.config.request_timeout_s,
                lora_adapter=self.config.lora_sync == "adapter",
                max_lora_rank=self.config.max_lora_rank,
            )
        return self._sampler

    @property
    def version(self) -> int:
        return self._sampler.policy_version if self._sampler else 0

    def start(self, policy: Any, version: int) -> None:
        """A started server serves ``[model] source``, which is only version 0 of a new run;
        a resumed run's weights, or anything a running server (``url``) may serve, are
        pushed now."""
        if version or self.config.url:
            self.after_step(policy, version)

    @contextmanager
    def sampling_ahead(self) -> Iterator[EngineSampler]:
        """The server's sampler (sampling ahead needs nothing more: it is another process)."""
        yield self.sampler

    def after_step(self, policy: Any, version: int) -> dict[str, float]:
        """Push the policy as ``version`` (the optimizer steps it has taken); metrics."""
        sampler = self.sampler
        assert self._sync is not None
        t0 = time.perf_counter()
        pushed = self._sync.push(policy, version)
        sampler.model = pushed["model"]
        sampler.policy_version = version
        return {
            "engine/policy_version": float(version),
            "time/weight_sync_s": time.perf_counter() - t0,
        }

    def stop(self) -> None:
        self.server.stop()
        self._sampler = self._sync = None

    def __enter__(self) -> PolicyEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def build_inference_engine(
    config: InferenceConfig,
    *,
    policy: Any,
    model_source: str,
    run_dir: str | Path,
    seed: int | None = None,
    sample_ahead: bool = False,
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> InferenceEngine:
    """The run's engine: the policy in process (its decode options from ``config``;
    ``sample_ahead``: a copy of the weights samples ahead, under ``autocast``), a vLLM
    server (:func:`build_policy_engine`), or a user's (``engine = "package.module:factory"``,
    called with ``config`` and the keyword arguments here)."""
    if ":" in config.engine:
        return _user_engine(
            config,
            policy=policy,
            model_source=model_source,
            run_dir=run_dir,
            seed=seed,
            sample_ahead=sample_ahead,
            autocast=autocast,
        )
    if config.engine == "in_process":
        from composer_replication.inference.decoding.generate import DecodeOptions
        from composer_replication.inference.in_process import InProcessEngine

        return InProcessEngine(
            policy,
            decode=DecodeOptions.of(config),
            sample_ahead=sample_ahead,
            autocast=autocast,
        )
    return build_policy_engine(config, model_source=model_source, run_dir=run_dir, seed=seed)


#: how a user's engine factory is called, for the messages that blame it
USER_ENGINE_CALL = (
    "factory(config, *, policy, model_source, run_dir, seed, sample_ahead, autocast) "
    "returning an object with the roles.InferenceEngine methods"
)


class BlamedSampler:
    """A user's sampler whose failures name where it came from: what it raised becomes one
    line naming ``what`` (the setting and the import path), the error and how it is called;
    everything else is the sampler's own."""

    def __init__(self, inner: Any, what: str) -> None:
        self._inner = inner
        self._what = what

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def sample_batch(self, *args: Any, **kwargs: Any) -> Any:
        from composer_replication.common.errors import UsageError, user_code_error

        try:
            return self._inner.sample_batch(*args, **kwargs)
        except UsageError:
            raise
        except Exception as err:  # the user's code: blame it, in one line
            raise user_code_error(
                self._what,
                err,
                "its sampler is called as sample_batch(tokenizer, prompts, settings, *, "
                "max_rows, on_row_done)",
            ) from err


def _user_engine(config: Any, **kwargs: Any) -> InferenceEngine:
    """A user's engine from its factory; a factory that fails, or returns something that is
    not an engine, is one line naming ``inference.engine`` and how it is called."""
    from composer_replication import roles
    from composer_replication.common.callables import load_callable
    from composer_replication.common.errors import UsageError, user_code_error

    what = f"inference.engine = {config.engine!r}"
    factory = load_callable(config.engine, "inference.engine (a user's engine factory)")
    try:
        engine = factory(config, **kwargs)
    except Exception as err:  # the user's code: blame it, in one line
        raise user_code_error(what, err, f"it is called as {USER_ENGINE_CALL}") from err
    # looked up on the class: reading a property could start the engine
    needed = (*roles.protocol_methods(roles.InferenceEngine), "sampler", "version")
    missing = [name for name in needed if not hasattr(type(engine), name)]
    if missing:
        raise UsageError(
            f"{what} returned {type(engine).__name__}, which lacks {', '.join(missing)}; "
            f"the factory is called as {USER_ENGINE_CALL}"
        )
    return engine


def build_policy_engine(
    config: VllmInferenceConfig,
    *,
    model_source: str,
    run_dir: str | Path,
    seed: int | None = None,
) -> PolicyEngine:
    """The vLLM engine of a run (one training process only)."""
    world = _training_world_size()
    if world > 1:
        raise ValueError(
            f"inference.engine = 'vllm' with {world} training ranks: the weight sync writes "
            "one process's whole policy, not FSDP shards; train in one process or use "
            "inference.engine = 'in_process'"
        )
    return PolicyEngine(
        config, model_dir=engine_model_dir(model_source), run_dir=run_dir, seed=seed
    )


def _training_world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
