"""The seed's module path for the object-store all-reduce and its torchft-shaped manager.

``ObjectStoreAllReduce`` lives in :mod:`.object_store`; ``MockManager`` (=
``ObjectStoreManager``) and ``_ImmediateWork`` (= ``CompletedWork``) in :mod:`.manager`;
these are the same objects.
"""

from __future__ import annotations

from composer_replication.diloco.serverless.manager import (
    CompletedWork,
    MockManager,
    ObjectStoreManager,
    _ImmediateWork,
)
from composer_replication.diloco.serverless.object_store import ObjectStoreAllReduce

__all__ = [
    "CompletedWork",
    "MockManager",
    "ObjectStoreAllReduce",
    "ObjectStoreManager",
    "_ImmediateWork",
]
