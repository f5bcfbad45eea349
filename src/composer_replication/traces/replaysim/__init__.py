"""replaysim: normalise trace-replay DPO pairs with a data-juicer recipe.

data-juicer is optional (the `replaysim` extra) and imported only inside `normalize` when
a recipe actually runs; `skip_dj=True` works without it.
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

__all__ = [
    "DEFAULT_RECIPE",
    "DJNormalizer",
    "NormalizationStats",
    "NormalizedDPOPair",
    "replay_and_normalize_trace",
    "replay_and_normalize_trace_sync",
]
