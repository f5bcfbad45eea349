"""Every configuration of a run, as typed pydantic models (TOML in, TOML out).

Pure data: this package imports no runtime module (no torch, no trainer), so a config can
be loaded, validated and checked anywhere. One owner per setting, one name per knob:

- :mod:`.run`: ``RunConfig`` (the whole run) and its tables: model, optim, envs, eval,
  guard, checkpoint;
- :mod:`.loss`: ``LossConfig`` (the loss components);
- :mod:`.algorithm` / :mod:`.advantage` / :mod:`.references`: one environment's algorithm
  (sampling + ``advantage.type``) and the models it refers to;
- :mod:`.diloco`: the DiLoCo outer loop;
- :mod:`.deprecation`: old field spellings, accepted with a warning;
- :mod:`.shorthands`: the write-only ``advantage`` shorthands, folded on raw input.
"""

from __future__ import annotations

from composer_replication.config.algorithm import AlgorithmConfig, SamplingConfig
from composer_replication.config.deprecation import ConfigDeprecationWarning
from composer_replication.config.diloco import DiLoCoConfig
from composer_replication.config.loss import COMPONENTS, LossConfig
from composer_replication.config.run import (
    CheckpointConfig,
    DockerSandboxConfig,
    EnvConfig,
    EvalConfig,
    GuardConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
)

__all__ = [
    "COMPONENTS",
    "AlgorithmConfig",
    "CheckpointConfig",
    "ConfigDeprecationWarning",
    "DiLoCoConfig",
    "DockerSandboxConfig",
    "EnvConfig",
    "EvalConfig",
    "GuardConfig",
    "LoraConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "RunConfig",
    "SamplingConfig",
]
