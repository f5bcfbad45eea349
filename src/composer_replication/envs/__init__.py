"""Environments: tasks, rollouts and rewards.

``build_environment(env_config)`` constructs an environment by name: a built-in one
(``config.environments.ENVIRONMENTS``: ``python_functions``, the embedded default, and
``feature_deletion``, tasks from ``composer-replication datagen``), or
``"pkg.module:factory"`` for a user environment (called with the config's options).
Evaluation-only suites (HumanEval) are refused with a ``ValueError``.
``env_config.sandbox`` picks the built-in environments' sandbox backend: ``"local"`` (their
default factory) or ``"docker"`` (a ``DockerSandboxFactory`` from ``env_config.docker``).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from composer_replication.common.errors import UsageError, user_code_error
from composer_replication.config.environments import BUILTIN_ENVIRONMENTS, builtin_environment
from composer_replication.config.sandbox import SANDBOX_ENVIRONMENTS
from composer_replication.envs.base import (
    DemonstratingEnvironment,
    Environment,
    SplitEnvironment,
    pass_at_1,
)

__all__ = [
    "DemonstratingEnvironment",
    "Environment",
    "SplitEnvironment",
    "build_environment",
    "pass_at_1",
]


def build_environment(env_config: Any) -> Environment:
    """The environment ``env_config.name`` names, built with ``env_config.options``.

    With ``env_config.sandbox == "docker"`` (an ``EnvConfig``; objects without the field
    are local) a built-in environment gets the environment module's
    ``docker_sandbox_factory(env_config.docker)`` as its ``sandbox_factory``.
    """
    from composer_replication.config.run import check_trainable_environment

    name, options = env_config.name, dict(env_config.options)
    check_trainable_environment(name)  # benchmarks (HumanEval) are evaluation only
    if getattr(env_config, "sandbox", "local") == "docker":
        options["sandbox_factory"] = _docker_sandbox_factory(name, env_config, options)
    builtin = builtin_environment(name)
    if builtin is not None:
        module, _, attr = builtin.cls.partition(":")
        return _construct(name, getattr(importlib.import_module(module), attr), options)
    if ":" in name:
        module, _, attr = name.partition(":")
        factory = getattr(importlib.import_module(module), attr)
        try:
            env = factory(**options)
        except Exception as err:  # the user's code: blame it, in one line
            raise user_code_error(
                f"environment {name!r}",
                err,
                f"called as {attr}(**options), options {sorted(options)}",
            ) from err
        if not isinstance(env, Environment):
            raise UsageError(
                f"environment {name!r} returned {type(env).__name__}, which is not an "
                "Environment (it needs task_ids() and rollouts(...))"
            )
        return env
    raise ValueError(
        f"unknown environment {name!r}; use {', '.join(BUILTIN_ENVIRONMENTS)} or "
        "'pkg.module:factory'"
    )


def _construct(name: str, cls: Any, options: dict[str, Any]) -> Any:
    """A built-in environment from its options: an option it does not take, or a value it
    refuses (a missing task file, a bad setting), is a one-line usage error."""
    params = inspect.signature(cls).parameters
    unknown = sorted(set(options) - set(params))
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        known = ", ".join(n for n, p in params.items() if p.kind is p.KEYWORD_ONLY or n != "self")
        raise UsageError(
            f"environment {name!r} has no option {unknown[0]!r} (envs options); its options: "
            f"{known}"
        )
    try:
        return cls(**options)
    except (FileNotFoundError, ValueError) as err:
        raise UsageError(f"environment {name!r}: {err}") from err


def _docker_sandbox_factory(name: str, env_config: Any, options: dict[str, Any]) -> Any:
    """The built-in environment's Docker factory, from the config's ``docker`` table."""
    builtin = builtin_environment(name)
    if builtin is None or not builtin.sandbox:
        raise ValueError(
            f"sandbox = 'docker' applies to {', '.join(SANDBOX_ENVIRONMENTS)}, not {name!r}; "
            "an environment factory builds its own sandboxes"
        )
    if "sandbox_factory" in options:
        raise ValueError(
            f"environment {name!r}: options.sandbox_factory and sandbox = 'docker' both choose "
            "the sandbox; keep one"
        )
    docker = getattr(env_config, "docker", None)
    if docker is None:
        raise ValueError(
            f"environment {name!r}: sandbox = 'docker' needs docker settings with an image, "
            "e.g. docker = { image = 'python:3.11-slim' }"
        )
    settings = docker.sandbox_kwargs() if hasattr(docker, "sandbox_kwargs") else dict(docker)
    return importlib.import_module(builtin.module).docker_sandbox_factory(settings)
