"""The built-in environments, declared once: each one's name, class and the facts about it
that the config, the command line and the run's setup need.

``envs.build_environment`` builds an environment from its entry here; the run config
(``sandbox``, echo's role attribution), ``preflight.check_env_name``, the ``eval`` command
and ``datagen.repository_tasks`` read the facts below instead of naming environments. Any
other environment is a user's ``"pkg.module:factory"``. Declarations only (no torch): the
config layer reads this module.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "DEFAULT_EVAL_MAX_NEW_TOKENS",
    "ENVIRONMENTS",
    "BuiltinEnvironment",
    "builtin_environment",
    "eval_max_new_tokens",
]

#: The ``eval`` command's generation budget per turn for an environment that declares none
#: (a user's factory).
DEFAULT_EVAL_MAX_NEW_TOKENS = 80


@dataclass(frozen=True)
class BuiltinEnvironment:
    """One built-in environment.

    Attributes:
        name: its ``[[envs]] name``.
        cls: ``"package.module:Class"`` of the environment, built with the entry's options.
        sandbox: it runs candidate code in sandboxes of its own choosing, so ``sandbox =
            "docker"`` applies (its module has ``docker_sandbox_factory(settings)``).
        repository_tasks: its tasks come from a task file ``datagen`` wrote or a repository
            (the ``task_file`` / ``repo`` options): nothing to run without one of them.
        role_attribution: its rollouts carry per-token roles (``Rollout.token_roles``:
            multi-turn, with observation tokens), which echo's ce trains on.
        eval_max_new_tokens: the ``eval`` command's default generation budget per turn.
    """

    name: str
    cls: str
    sandbox: bool
    repository_tasks: bool
    role_attribution: bool
    eval_max_new_tokens: int = DEFAULT_EVAL_MAX_NEW_TOKENS

    @property
    def module(self) -> str:
        """The module that defines it (and its ``docker_sandbox_factory``)."""
        return self.cls.partition(":")[0]


ENVIRONMENTS: dict[str, BuiltinEnvironment] = {
    env.name: env
    for env in (
        BuiltinEnvironment(
            name="python_functions",
            cls="composer_replication.envs.python_functions:PythonFunctionsEnv",
            sandbox=True,
            repository_tasks=False,
            role_attribution=False,  # single-turn: every completion token is sampled
        ),
        BuiltinEnvironment(
            name="feature_deletion",
            cls="composer_replication.envs.feature_deletion:FeatureDeletionEnv",
            sandbox=True,
            repository_tasks=True,
            role_attribution=True,
            eval_max_new_tokens=256,
        ),
    )
}

#: The built-in environment names.
BUILTIN_ENVIRONMENTS = tuple(ENVIRONMENTS)


def eval_max_new_tokens(name: str) -> int:
    """The ``eval`` command's default generation budget per turn on environment ``name``."""
    builtin = ENVIRONMENTS.get(name)
    return DEFAULT_EVAL_MAX_NEW_TOKENS if builtin is None else builtin.eval_max_new_tokens


def builtin_environment(name: str) -> BuiltinEnvironment | None:
    """The built-in environment ``name`` names; None for anything else (a user's
    ``"pkg.module:factory"``, or a name that is no environment)."""
    return ENVIRONMENTS.get(name)
