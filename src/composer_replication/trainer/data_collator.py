"""The seed API's path of the trl backend's data collator: the same objects as
:mod:`composer_replication.backends.trl.data_collator`."""

from composer_replication.backends.trl.data_collator import (
    ROLES,
    CollatorConfig,
    ComposerDataCollator,
    TokenizerLike,
    TraceExample,
    TraceTurn,
)

__all__ = [
    "ROLES",
    "CollatorConfig",
    "ComposerDataCollator",
    "TokenizerLike",
    "TraceExample",
    "TraceTurn",
]
