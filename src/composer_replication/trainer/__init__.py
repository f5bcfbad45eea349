"""The trainer: loss components, the algorithm-blind step, teacher models, and the trl
integration (``ComposerReplicationTrainer`` and the policy-optimisation presets).

The trl names load lazily (PEP 562): importing this package never imports trl.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> module that defines it
_LAZY: dict[str, str] = {
    "ComposerReplicationTrainer": "composer_replication.trainer.composer_trainer",
    "PO_OBJECTIVES": "composer_replication.trainer.po_presets",
    "make_dr_grpo_config": "composer_replication.trainer.po_presets",
    "make_po_config": "composer_replication.trainer.po_presets",
}

__all__ = ["PO_OBJECTIVES", "ComposerReplicationTrainer", "make_dr_grpo_config", "make_po_config"]

if TYPE_CHECKING:
    from composer_replication.trainer.composer_trainer import ComposerReplicationTrainer
    from composer_replication.trainer.po_presets import (
        PO_OBJECTIVES,
        make_dr_grpo_config,
        make_po_config,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:  # AttributeError lets `from ... import submodule` fall back to importing it
        raise AttributeError(f"module 'composer_replication.trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
