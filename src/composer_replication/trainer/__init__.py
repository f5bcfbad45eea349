"""The seed API's face of the trl backend (``backends/trl``): ``ComposerReplicationTrainer``,
loaded lazily (PEP 562: importing this package never imports trl), the
policy-optimisation presets, and ``.data_collator``.

The native training loop is :mod:`composer_replication.training`; it imports nothing
from here, so the backends and the loop they share import one way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from composer_replication.backends.trl.po_presets import (
    PO_OBJECTIVES,
    make_dr_grpo_config,
    make_po_config,
)

__all__ = ["PO_OBJECTIVES", "ComposerReplicationTrainer", "make_dr_grpo_config", "make_po_config"]

if TYPE_CHECKING:
    from composer_replication.backends.trl.trainer import ComposerReplicationTrainer


def __getattr__(name: str) -> Any:
    if name == "ComposerReplicationTrainer":  # imports trl, transformers and torch: on first use
        from composer_replication.backends.trl.trainer import ComposerReplicationTrainer

        globals()[name] = ComposerReplicationTrainer  # the next access is a plain lookup
        return ComposerReplicationTrainer
    # AttributeError lets `from ... import submodule` fall back to importing it
    raise AttributeError(f"module 'composer_replication.trainer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "ComposerReplicationTrainer"])
