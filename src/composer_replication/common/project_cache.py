"""Where this project keeps what it makes once and reuses (converted models, generated tasks):
one root, from the environment or the user's cache folder. Imports nothing of the project, so
any module (the output policy included) can ask where it is."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_ENV_VAR", "cache_dir"]

CACHE_ENV_VAR = "COMPOSER_REPLICATION_CACHE"


def cache_dir() -> Path:
    """Root of this project's on-disk cache: `$COMPOSER_REPLICATION_CACHE` if set and non-empty,
    else `~/.cache/composer_replication`. Not created here."""
    env = os.environ.get(CACHE_ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "composer_replication"
