"""Serverless DiLoCo: replicas with no network between them meet through an object store.

``ObjectStoreAllReduce`` averages a tensor per round through any fsspec URI;
``ObjectStoreManager`` (alias ``MockManager``) puts the torchft ``Manager`` surface on it;
``replica_entrypoint`` is what a replica runs. Executors implementing
``ServerlessExecutor`` launch the replicas: ``LocalProcessExecutor`` here, and
``eks.EKSExecutor``, ``sagemaker.SageMakerExecutor``, ``modal.ModalExecutor``,
``hf_jobs.HFJobsExecutor`` in their modules (cloud SDKs load lazily).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from composer_replication.diloco.serverless.base import (
    RANK_ENV,
    STATUSES,
    WORLD_SIZE_ENV,
    ReplicaHandle,
    ServerlessExecutor,
)
from composer_replication.diloco.serverless.eks import EKSExecutor
from composer_replication.diloco.serverless.hf_jobs import HFJobsExecutor
from composer_replication.diloco.serverless.local import LocalProcessExecutor
from composer_replication.diloco.serverless.modal import ModalExecutor
from composer_replication.diloco.serverless.sagemaker import SageMakerExecutor

# The object-store all-reduce and manager import torch: name -> module, loaded on first use.
_TORCH_NAMES: dict[str, str] = {
    "ObjectStoreAllReduce": "composer_replication.diloco.serverless.object_store",
    "ObjectStoreManager": "composer_replication.diloco.serverless.manager",
    "MockManager": "composer_replication.diloco.serverless.manager",
}

if TYPE_CHECKING:
    from composer_replication.diloco.serverless.manager import MockManager, ObjectStoreManager
    from composer_replication.diloco.serverless.object_store import ObjectStoreAllReduce

__all__ = [
    "RANK_ENV",
    "STATUSES",
    "WORLD_SIZE_ENV",
    "EKSExecutor",
    "HFJobsExecutor",
    "LocalProcessExecutor",
    "MockManager",
    "ModalExecutor",
    "ObjectStoreAllReduce",
    "ObjectStoreManager",
    "ReplicaHandle",
    "SageMakerExecutor",
    "ServerlessExecutor",
]


def __getattr__(name: str) -> Any:
    module = _TORCH_NAMES.get(name)
    if module is None:
        raise AttributeError(
            f"module 'composer_replication.diloco.serverless' has no attribute {name!r}"
        )
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_TORCH_NAMES))
