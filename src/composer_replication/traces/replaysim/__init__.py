"""replaysim: normalise trace-replay DPO pairs with a data-juicer recipe.

data-juicer is optional (the `replaysim` extra) and imported only inside `normalize` when
a recipe actually runs; `skip_dj=True` works without it. The teacher-replay names a
replaysim user needs (`DPOPair`, `TeacherCallResult`, `extract_dpo_pairs`, `replay_trace`)
are re-exported here: the same objects as in `traces.teacher_replay`.
"""

from __future__ import annotations

from composer_replication.traces.replaysim.normalize import (
    DEFAULT_RECIPE,
    DJNormalizer,
    NormalizationStats,
    NormalizedDPOPair,
    replay_and_normalize_trace,
    replay_and_normalize_trace_sync,
)
from composer_replication.traces.teacher_replay.pairs import extract_dpo_pairs
from composer_replication.traces.teacher_replay.records import DPOPair, TeacherCallResult
from composer_replication.traces.teacher_replay.replay import replay_trace

__all__ = [
    "DEFAULT_RECIPE",
    "DJNormalizer",
    "DPOPair",
    "NormalizationStats",
    "NormalizedDPOPair",
    "TeacherCallResult",
    "extract_dpo_pairs",
    "replay_and_normalize_trace",
    "replay_and_normalize_trace_sync",
    "replay_trace",
]
