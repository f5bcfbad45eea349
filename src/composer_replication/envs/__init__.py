"""Environments: tasks, rollouts and rewards.

``build_environment(env_config)`` constructs an environment by name: ``python_functions``
(the embedded default), ``feature_deletion`` (tasks from ``composer-replication datagen``),
or ``"pkg.module:factory"`` for a user environment (called with the config's options).
"""

from __future__ import annotations

import importlib
from typing import Any

from composer_replication.envs.base import Environment, pass_at_1

__all__ = ["Environment", "build_environment", "pass_at_1"]


def build_environment(env_config: Any) -> Environment:
    """The environment ``env_config.name`` names, built with ``env_config.options``."""
    name, options = env_config.name, dict(env_config.options)
    if name == "python_functions":
        from composer_replication.envs.python_functions import PythonFunctionsEnv

        return PythonFunctionsEnv(**options)
    if name == "feature_deletion":
        from composer_replication.envs.feature_deletion import FeatureDeletionEnv

        return FeatureDeletionEnv(**options)
    if ":" in name:
        module, _, attr = name.partition(":")
        factory = getattr(importlib.import_module(module), attr)
        env = factory(**options)
        if not isinstance(env, Environment):
            raise TypeError(f"{name} returned {type(env).__name__}, which is not an Environment")
        return env
    raise ValueError(
        f"unknown environment {name!r}; use python_functions, feature_deletion or "
        "'pkg.module:factory'"
    )
