"""Frozen models served by the inference engine: opd / opsd references and sft sources.

With ``[inference] engine = "vllm"`` and ``serve_frozen = true`` (the default), every frozen
model a run config gives by ``local_path`` (``advantage.model`` of opd / opsd,
``sampling.source`` of sft) is served by an engine server of its own, started like the
policy's (loopback, the engine's virtualenv, stopped on every exit path) but never synced:
its weights do not change. :meth:`FrozenEngines.start` answers which endpoint serves each
``local_path``, and :func:`served` gives an environment's config that reads the model there,
so the algorithms score (vLLM ``prompt_logprobs``) and sample through the same endpoint
clients they use for any OpenAI-compatible server. One server per distinct ``local_path``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_replication.config.references import FrozenEndpoint, LocalFrozenModel
from composer_replication.inference.engine import engine_model_dir
from composer_replication.inference.server import SERVED_MODEL_NAME, EngineServer

if TYPE_CHECKING:
    from composer_replication.config.inference import VllmInferenceConfig
    from composer_replication.config.run import EnvConfig

__all__ = ["FrozenEngines", "local_frozen_paths", "served"]

#: where an environment's algorithm names a frozen model (in its model_dump)
_REFERENCE_SLOTS = (("sampling", "source"), ("advantage", "model"))


def _references(env: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """(parent table, key) of every reference slot the environment's algorithm fills."""
    found = []
    algorithm = env.get("algorithm") or {}
    for table, key in _REFERENCE_SLOTS:
        parent = algorithm.get(table) or {}
        if isinstance(parent.get(key), dict):
            found.append((parent, key))
    return found


def local_frozen_paths(envs: Sequence[EnvConfig]) -> list[str]:
    """The distinct ``local_path`` of every frozen model the ``[[envs]]`` entries load, in
    order."""
    paths: list[str] = []
    for env in (entry.model_dump(mode="json") for entry in envs):
        for parent, key in _references(env):
            path = parent[key].get("local_path")
            if path and path not in paths:
                paths.append(path)
    return paths


class FrozenEngines:
    """The engine servers of a run's frozen models (see the module docstring)."""

    def __init__(
        self, inference: VllmInferenceConfig, envs: Sequence[EnvConfig], *, log_dir: str | Path
    ) -> None:
        self.inference = inference
        self.envs = list(envs)
        self.log_dir = Path(log_dir)
        self.servers: dict[str, EngineServer] = {}

    @staticmethod
    def wanted(inference: Any, envs: Sequence[EnvConfig]) -> bool:
        """Whether a run with this ``[inference]`` section and these ``[[envs]]`` serves its
        frozen models (a vLLM engine with ``serve_frozen``, and a frozen ``local_path``)."""
        return (
            inference.engine == "vllm"
            and getattr(inference, "serve_frozen", False)
            and bool(local_frozen_paths(envs))
        )

    def start(self) -> dict[str, FrozenEndpoint]:
        """Start one server per frozen ``local_path``; the endpoint that serves each path."""
        engine_config = self.inference.model_copy(
            update={"url": None, "port": 0, "lora_sync": "merged", "async_level": 0}
        )
        try:
            for i, path in enumerate(local_frozen_paths(self.envs)):
                try:
                    model_dir = engine_model_dir(path)
                except ValueError:
                    raise ValueError(
                        f"frozen model local_path={path!r}: the inference engine serves a plain "
                        "Hugging Face directory (config.json + safetensors) or 'embedded'; "
                        "convert it, or set inference.serve_frozen = false to load it in process"
                    ) from None
                server = EngineServer(
                    engine_config, model_dir, log_path=self.log_dir / f"engine_frozen_{i}.log"
                )
                self.servers[path] = server.start()
        except BaseException:
            self.stop()
            raise
        return {
            path: FrozenEndpoint(name=SERVED_MODEL_NAME, base_url=f"{server.base_url}/v1")
            for path, server in self.servers.items()
        }

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.servers.clear()


def served(env_config: EnvConfig, endpoints: Mapping[str, FrozenEndpoint]) -> EnvConfig:
    """``env_config`` with every frozen model it loads from a served ``local_path``
    (``sampling.source``, ``advantage.model``) read from that path's endpoint instead."""

    def swapped(reference: Any) -> Any:
        if isinstance(reference, LocalFrozenModel) and reference.local_path in endpoints:
            return endpoints[reference.local_path]
        return reference

    algorithm = env_config.algorithm
    updates: dict[str, Any] = {}
    source = swapped(algorithm.sampling.source)
    if source is not algorithm.sampling.source:
        updates["sampling"] = algorithm.sampling.model_copy(update={"source": source})
    advantage = algorithm.advantage
    if "model" in type(advantage).model_fields:
        model = swapped(advantage.model)
        if model is not advantage.model:
            updates["advantage"] = advantage.model_copy(update={"model": model})
    if not updates:
        return env_config
    return env_config.model_copy(update={"algorithm": algorithm.model_copy(update=updates)})
