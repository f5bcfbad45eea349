"""Inference engines for the policy's rollouts (:class:`~composer_replication.roles.
InferenceEngine`): the policy in process (``[inference] engine = "in_process"``), or a vLLM
server on loopback, its token-in / token-out sampler and the versioned weight sync
(``engine = "vllm"``)."""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "EngineSampler": "composer_replication.inference.sampler",
    "EngineServer": "composer_replication.inference.server",
    "EngineStartError": "composer_replication.inference.server",
    "InProcessEngine": "composer_replication.inference.in_process",
    "PolicyEngine": "composer_replication.inference.engine",
    "WeightSync": "composer_replication.inference.weight_sync",
    "build_inference_engine": "composer_replication.inference.engine",
    "build_policy_engine": "composer_replication.inference.engine",
    "engine_model_dir": "composer_replication.inference.engine",
    "engine_state_dict": "composer_replication.inference.weight_sync",
    "write_weights": "composer_replication.inference.weight_sync",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
