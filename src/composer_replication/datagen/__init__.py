"""Task generation: FeatureDeletion with its five solvability gates, leak scrubbing, the hack
monitor and the difficulty curriculum.

Modules: `feature_deletion` (+ `gates`), `curriculum`, `cli`. What the environments
share with the generator lives below both: the task records in `envs.fd_tasks`, the hack
monitor in `safety.hack_monitor`, leak scrubbing in `sandbox.scrub`, the sandboxes in
:mod:`composer_replication.sandbox`; their first public paths here (`datagen.fd_tasks`,
`datagen.hack_monitor`, `datagen.scrub`, `datagen.sandbox`, `datagen.docker_sandbox`) and
the names below still reach them. Names load lazily (PEP 562): the command line imports
this package to register ``datagen``, and the generator with its sandboxes would add a
sixth of a second to every command's start.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY: dict[str, str] = {
    "SANDBOX_DENYLIST": "composer_replication.sandbox.base",
    "TestRunResult": "composer_replication.sandbox.base",
    "Sandbox": "composer_replication.sandbox.protocol",
    "FakeSandbox": "composer_replication.sandbox.protocol",
    "LocalSubprocessSandbox": "composer_replication.sandbox.local",
    "DockerSandbox": "composer_replication.sandbox.docker",
    "scrub_tree": "composer_replication.sandbox.scrub",
    "HackMonitor": "composer_replication.safety.hack_monitor",
    "HackVerdict": "composer_replication.safety.hack_monitor",
    "HackLog": "composer_replication.safety.hack_monitor",
    "Manifest": "composer_replication.safety.hack_monitor",
    "score_with_monitor": "composer_replication.safety.hack_monitor",
    "FDTask": "composer_replication.envs.fd_tasks",
    "TaskReference": "composer_replication.envs.fd_tasks",
    "GenerationReport": "composer_replication.datagen.feature_deletion",
    "generate_tasks": "composer_replication.datagen.feature_deletion",
    "SolvabilityValidator": "composer_replication.datagen.gates",
    "DifficultyCurriculum": "composer_replication.envs.curriculum",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'composer_replication.datagen' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
