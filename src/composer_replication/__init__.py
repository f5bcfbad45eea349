"""composer-replication: post-train coding agents with the Composer recipe.

Top-level names load lazily (PEP 562), so ``import composer_replication`` stays cheap and
imports neither torch nor any optional dependency until a name is used.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from composer_replication import _moved

__version__ = "0.1.0"

# Modules that moved stay importable under their first public paths (see _moved).
_moved.install()

# name -> module that defines it
_LAZY: dict[str, str] = {
    "compose_loss": "composer_replication.loss",
    "LossComponents": "composer_replication.loss",
    "build_batch": "composer_replication.batch",
    "generalized_jsd_loss": "composer_replication.opsd",
    "ClaudeCodeIngester": "composer_replication.traces.ingestion.claude_code",
    "IngestionStats": "composer_replication.traces.ingestion.claude_code",
    "SYSTEM_PROMPT": "composer_replication.traces.ingestion.claude_code",
    "DEFAULT_TEACHERS": "composer_replication.traces.teacher_replay",
    "DPOPair": "composer_replication.traces.teacher_replay",
    "TeacherCallResult": "composer_replication.traces.teacher_replay",
    "TeacherSpec": "composer_replication.traces.teacher_replay",
    "TraceState": "composer_replication.traces.teacher_replay",
    "extract_dpo_pairs": "composer_replication.traces.teacher_replay",
    "replay_trace": "composer_replication.traces.teacher_replay",
    "ComposerReplicationTrainer": "composer_replication.backends.trl.trainer",
    "PO_OBJECTIVES": "composer_replication.backends.trl.po_presets",
    "make_dr_grpo_config": "composer_replication.backends.trl.po_presets",
    "make_po_config": "composer_replication.backends.trl.po_presets",
}

# True when the optional torchft dependency (DiLoCo) is importable.
_DILOCO_AVAILABLE: bool = importlib.util.find_spec("torchft") is not None
# torchft's DiLoCo outer loop; None when torchft is absent.
make_diloco_outer_loop = None
if _DILOCO_AVAILABLE:
    del make_diloco_outer_loop
    _LAZY["make_diloco_outer_loop"] = "composer_replication.diloco.outer_loop"

__all__ = [
    "DEFAULT_TEACHERS",
    "PO_OBJECTIVES",
    "SYSTEM_PROMPT",
    "_DILOCO_AVAILABLE",
    "ClaudeCodeIngester",
    "ComposerReplicationTrainer",
    "DPOPair",
    "IngestionStats",
    "LossComponents",
    "TeacherCallResult",
    "TeacherSpec",
    "TraceState",
    "__version__",
    "build_batch",
    "compose_loss",
    "extract_dpo_pairs",
    "generalized_jsd_loss",
    "make_diloco_outer_loop",
    "make_dr_grpo_config",
    "make_po_config",
    "replay_trace",
]

if TYPE_CHECKING:
    from composer_replication.backends.trl.po_presets import (
        PO_OBJECTIVES,
        make_dr_grpo_config,
        make_po_config,
    )
    from composer_replication.backends.trl.trainer import ComposerReplicationTrainer
    from composer_replication.batch import build_batch
    from composer_replication.loss import LossComponents, compose_loss
    from composer_replication.opsd import generalized_jsd_loss
    from composer_replication.traces.ingestion.claude_code import (
        SYSTEM_PROMPT,
        ClaudeCodeIngester,
        IngestionStats,
    )
    from composer_replication.traces.teacher_replay import (
        DEFAULT_TEACHERS,
        DPOPair,
        TeacherCallResult,
        TeacherSpec,
        TraceState,
        extract_dpo_pairs,
        replay_trace,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'composer_replication' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: the next access is a plain attribute lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
