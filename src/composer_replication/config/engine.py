"""Old names of :mod:`.roles` (the ``[engine]`` table is now ``[roles]``, keyed on
``placement``), kept importable."""

from __future__ import annotations

from composer_replication.config.placement import ROLE_PLACEMENTS as ENGINE_NAMES
from composer_replication.config.roles import InProcessRoles as InProcessEngineConfig
from composer_replication.config.roles import MonarchRoles as MonarchEngineConfig
from composer_replication.config.roles import RolesConfig as EngineConfig
from composer_replication.config.roles import roles_config as engine_config

__all__ = [
    "ENGINE_NAMES",
    "EngineConfig",
    "InProcessEngineConfig",
    "MonarchEngineConfig",
    "engine_config",
]
