"""Task generation: FeatureDeletion with its 4 solvability gates, leak scrubbing, the hack
monitor and the difficulty curriculum.

Modules: `scrub`, `hack_monitor`, `feature_deletion` (+ `fd_tasks`, `gates`),
`curriculum`, `cli`. The sandboxes live in :mod:`composer_replication.sandbox`; their
first public paths here (`datagen.sandbox`, `datagen.docker_sandbox`) and the names below
still reach them. Names load lazily, so importing the package imports neither docker nor
rich.
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
    "scrub_tree": "composer_replication.datagen.scrub",
    "HackMonitor": "composer_replication.datagen.hack_monitor",
    "HackVerdict": "composer_replication.datagen.hack_monitor",
    "HackLog": "composer_replication.datagen.hack_monitor",
    "Manifest": "composer_replication.datagen.hack_monitor",
    "score_with_monitor": "composer_replication.datagen.hack_monitor",
    "FDTask": "composer_replication.datagen.fd_tasks",
    "TaskReference": "composer_replication.datagen.fd_tasks",
    "GenerationReport": "composer_replication.datagen.feature_deletion",
    "generate_tasks": "composer_replication.datagen.feature_deletion",
    "SolvabilityValidator": "composer_replication.datagen.gates",
    "DifficultyCurriculum": "composer_replication.datagen.curriculum",
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
