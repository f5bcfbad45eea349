"""Frozen models served by the inference engine: opd / opsd references and sft sources.

With ``[inference] engine = "vllm"`` and ``serve_frozen = true`` (the default), every frozen
model a run config gives by ``local_path`` (``advantage.model`` of opd / opsd,
``sampling.source`` of sft) is served by an engine server of its own, started like the
policy's (loopback, the engine's virtualenv, stopped on every exit path) but never synced:
its weights do not change. The references are rewritten to that server's endpoint, so the
algorithms score (vLLM ``prompt_logprobs``) and sample through the same endpoint clients
they use for any OpenAI-compatible server. One server per distinct ``local_path``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_replication.inference.engine import engine_model_dir
from composer_replication.inference.server import SERVED_MODEL_NAME, EngineServer

if TYPE_CHECKING:
    from composer_replication.config.run import RunConfig

__all__ = ["FrozenEngines", "local_frozen_paths"]

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


def local_frozen_paths(config: RunConfig) -> list[str]:
    """The distinct ``local_path`` of every frozen model the config loads, in order."""
    paths: list[str] = []
    for env in config.model_dump(mode="json")["envs"]:
        for parent, key in _references(env):
            path = parent[key].get("local_path")
            if path and path not in paths:
                paths.append(path)
    return paths


class FrozenEngines:
    """The engine servers of a run's frozen models (see the module docstring)."""

    def __init__(self, config: RunConfig, *, log_dir: str | Path) -> None:
        self.config = config
        self.log_dir = Path(log_dir)
        self.servers: dict[str, EngineServer] = {}

    @staticmethod
    def wanted(config: RunConfig) -> bool:
        inference = config.inference
        return (
            inference.engine == "vllm"
            and inference.serve_frozen
            and bool(local_frozen_paths(config))
        )

    def start(self) -> RunConfig:
        """Start one server per frozen ``local_path``; the config with those references
        pointing at their servers."""
        engine_config = self.config.inference.model_copy(
            update={"url": None, "port": 0, "lora_sync": "merged", "async_level": 0}
        )
        try:
            for i, path in enumerate(local_frozen_paths(self.config)):
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
        data = self.config.model_dump(mode="json")
        for env in data["envs"]:
            for parent, key in _references(env):
                reference = parent[key]
                server = self.servers.get(reference.get("local_path", ""))
                if server is not None:
                    parent[key] = {"name": SERVED_MODEL_NAME, "base_url": f"{server.base_url}/v1"}
        return type(self.config).model_validate(data)

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.servers.clear()
