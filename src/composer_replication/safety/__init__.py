"""Run-level safety: the kill switch on held-out collapse and the train / held-out split.

See `kill_switch` (`HeldOutGuard`, the latching tripwire fed once per evaluation round) and
`holdout` (`HeldoutSplit`, which decides which tasks can ever be trained on). Pure Python:
importing this package never imports torch.
"""

from __future__ import annotations

from composer_replication.safety.holdout import (
    DEFAULT_SPLIT,
    HeldoutLeakError,
    HeldoutSplit,
    HeldoutSplitMismatch,
    check_same_split,
)
from composer_replication.safety.kill_switch import (
    CollapseStopError,
    HeldOutGuard,
    TripwireStatus,
    kl_token_trust_filter,
)

__all__ = [
    "DEFAULT_SPLIT",
    "CollapseStopError",
    "HeldOutGuard",
    "HeldoutLeakError",
    "HeldoutSplit",
    "HeldoutSplitMismatch",
    "TripwireStatus",
    "check_same_split",
    "kl_token_trust_filter",
]
