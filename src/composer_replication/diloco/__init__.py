"""Decentralised training with DiLoCo (arXiv:2311.08105): replicas train apart, sync rarely.

- ``make_diloco_outer_loop``: torchft's ``DiLoCo`` context manager (extra ``diloco``);
  ``start_lighthouse`` / ``make_torchft_manager`` set torchft up on CPU.
- ``diloco_context`` / ``DiLoCoConfig``: the hook the training loop wraps its steps in,
  ``nullcontext`` when off; the ``object_store`` backend needs no torchft at all.
- ``serverless``: replicas that meet only through an object store, and the executors that
  launch them (local processes, EKS, SageMaker, Modal, HF Jobs).

``_DummyWork`` is the seed's name of ``serverless.manager.CompletedWork``, an
already-completed all-reduce ``Work``. Names load lazily (PEP 562): importing this package imports neither torch nor torchft.
``DiLoCo`` and ``Manager`` are torchft's classes, or None when torchft is not installed.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

# True when the optional torchft dependency is importable (checked without importing it).
_TORCHFT_AVAILABLE: bool = importlib.util.find_spec("torchft") is not None

_LAZY: dict[str, str] = {
    "make_diloco_outer_loop": "composer_replication.diloco.outer_loop",
    "make_torchft_manager": "composer_replication.diloco.outer_loop",
    "start_lighthouse": "composer_replication.diloco.outer_loop",
    "DiLoCoConfig": "composer_replication.diloco.integration",
    "diloco_context": "composer_replication.diloco.integration",
    "ObjectStoreDiLoCo": "composer_replication.diloco.integration",
    "NO_SYNC": "composer_replication.diloco.integration",
}
# seed names of objects that live under another name: name -> (module, attribute)
_ALIASES: dict[str, tuple[str, str]] = {
    "_DummyWork": ("composer_replication.diloco.serverless.manager", "CompletedWork"),
}
_TORCHFT_NAMES = {"DiLoCo": "torchft.local_sgd", "Manager": "torchft.manager"}

__all__ = [
    "NO_SYNC",
    "_TORCHFT_AVAILABLE",
    "DiLoCo",
    "DiLoCoConfig",
    "Manager",
    "ObjectStoreDiLoCo",
    "diloco_context",
    "make_diloco_outer_loop",
    "make_torchft_manager",
    "start_lighthouse",
]


def __getattr__(name: str) -> Any:
    if name in _TORCHFT_NAMES:
        value = (
            getattr(importlib.import_module(_TORCHFT_NAMES[name]), name)
            if _TORCHFT_AVAILABLE
            else None
        )
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _ALIASES:
        module, attribute = _ALIASES[name]
        value = getattr(importlib.import_module(module), attribute)
    else:
        raise AttributeError(f"module 'composer_replication.diloco' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_ALIASES) | set(_TORCHFT_NAMES))
