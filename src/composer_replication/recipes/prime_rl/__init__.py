"""PRIME-RL recipe: our loss inside PRIME-RL's trainer, and our run config as a PRIME-RL
``rl`` TOML.

- :mod:`.composer_loss`: :func:`prime_rl_loss` (the ``[trainer.loss] type = "custom"``
  target, :data:`IMPORT_PATH`) and :func:`loss_fn` (the same sum as a tensor);
- :mod:`.export`: :func:`export_run_config` (``composer-replication export prime-rl``).

Nothing here imports PRIME-RL, and the core package never imports this recipe.
"""

from __future__ import annotations

from composer_replication.recipes.prime_rl.composer_loss import (
    DEFAULT_KNOBS,
    IMPORT_PATH,
    LossOutputs,
    loss_fn,
    prime_rl_loss,
)

__all__ = ["DEFAULT_KNOBS", "IMPORT_PATH", "LossOutputs", "loss_fn", "prime_rl_loss"]
