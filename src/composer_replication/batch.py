"""The seed API's path of the padded input dict of ``compose_loss`` (``build_batch``):
the same objects as :mod:`composer_replication.ops.compose_batch`, where the code lives."""

from composer_replication.ops.compose_batch import (
    Example,
    PreferencePair,
    build_batch,
)

__all__ = [
    "Example",
    "PreferencePair",
    "build_batch",
]
