"""PRIME-RL recipe: our loss inside PRIME-RL's trainer, and our run config as a PRIME-RL
``rl`` TOML.

- :mod:`.composer_loss`: :func:`prime_rl_loss` (the ``[trainer.loss] type = "custom"``
  target, :data:`IMPORT_PATH`) and :func:`loss_fn` (the same sum as a tensor);
- :mod:`.export`: :func:`export_run_config` (``composer-replication export prime-rl``).

Nothing here imports PRIME-RL, and the core package never imports this recipe. The names
load lazily (PEP 562), so the command line registers ``export`` without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> module that defines it
_LAZY: dict[str, str] = {
    "DEFAULT_KNOBS": "composer_replication.recipes.prime_rl.composer_loss",
    "IMPORT_PATH": "composer_replication.recipes.prime_rl.composer_loss",
    "LossOutputs": "composer_replication.recipes.prime_rl.composer_loss",
    "loss_fn": "composer_replication.recipes.prime_rl.composer_loss",
    "prime_rl_loss": "composer_replication.recipes.prime_rl.composer_loss",
    "PrimeRLExport": "composer_replication.recipes.prime_rl.export",
    "UnsupportedAlgorithmError": "composer_replication.recipes.prime_rl.export",
    "export_run_config": "composer_replication.recipes.prime_rl.export",
}

__all__ = [
    "DEFAULT_KNOBS",
    "IMPORT_PATH",
    "LossOutputs",
    "PrimeRLExport",
    "UnsupportedAlgorithmError",
    "export_run_config",
    "loss_fn",
    "prime_rl_loss",
]

if TYPE_CHECKING:
    from composer_replication.recipes.prime_rl.composer_loss import (
        DEFAULT_KNOBS,
        IMPORT_PATH,
        LossOutputs,
        loss_fn,
        prime_rl_loss,
    )
    from composer_replication.recipes.prime_rl.export import (
        PrimeRLExport,
        UnsupportedAlgorithmError,
        export_run_config,
    )


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
