"""The seed's module path for the executor protocol and the local executor.

``ReplicaHandle`` and ``ServerlessExecutor`` live in :mod:`.base`, ``LocalProcessExecutor``
in :mod:`.local`; these are the same objects.
"""

from __future__ import annotations

from composer_replication.diloco.serverless.base import ReplicaHandle, ServerlessExecutor
from composer_replication.diloco.serverless.local import LocalProcessExecutor

__all__ = ["LocalProcessExecutor", "ReplicaHandle", "ServerlessExecutor"]
