"""`ReplaySummary` (cost and latency of a replay run) and `ReplayProgress` (live counters)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from composer_replication.traces.teacher_replay.records import TeacherCallResult, error_kind

__all__ = ["ReplayProgress", "ReplaySummary"]


@dataclass(frozen=True)
class ReplayProgress:
    """Passed to the `progress` callback after every finished row."""

    done: int
    total: int
    n_cache_hits: int
    n_errors: int
    spend_usd: float
    max_total_usd: float


def _percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (the smallest value with at least q of the data at or below)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass(frozen=True)
class ReplaySummary:
    """Cost and latency of one replay run.

    Attributes:
        n_rows: rows returned (states x teachers).
        n_ok: rows with a response.
        n_cache_hits: rows served from the cache (no request, no spend this run).
        n_calls: rows not served from the cache (attempted or refused by the budget).
        n_requests: HTTP requests sent this run, retries included.
        n_retries: of those, retries.
        errors_by_kind: error rows per kind ("http_429", "timeout", ...).
        spend_usd: spend settled this run (see `SpendBudget`); cached rows cost nothing.
        max_total_usd: the cap.
        overshoot_usd: settled spend above the reservations (0 when the guarantee held).
        latency_p50_s / latency_p95_s: nearest-rank percentiles of `latency_s` over the
            successful rows answered this run; None when there are none.
        wall_s: wall-clock seconds of the run.
    """

    n_rows: int
    n_ok: int
    n_cache_hits: int
    n_calls: int
    n_requests: int
    n_retries: int
    errors_by_kind: dict[str, int]
    spend_usd: float
    max_total_usd: float
    overshoot_usd: float
    latency_p50_s: float | None
    latency_p95_s: float | None
    wall_s: float

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[TeacherCallResult],
        *,
        max_total_usd: float = math.nan,
        spend_usd: float | None = None,
        overshoot_usd: float = 0.0,
        n_requests: int | None = None,
        n_retries: int = 0,
        wall_s: float = 0.0,
    ) -> ReplaySummary:
        """Summarise rows (e.g. a results file); unknown run counters default from rows."""
        fresh = [r for r in rows if not r.get("cached", False)]
        latencies = sorted(r["latency_s"] for r in fresh if r["error"] is None)
        kinds = Counter(error_kind(r["error"]) for r in rows if r["error"] is not None)
        return cls(
            n_rows=len(rows),
            n_ok=sum(r["error"] is None for r in rows),
            n_cache_hits=len(rows) - len(fresh),
            n_calls=len(fresh),
            n_requests=sum(r.get("attempts", 1) for r in fresh)
            if n_requests is None
            else n_requests,
            n_retries=n_retries,
            errors_by_kind=dict(sorted(kinds.items())),  # type: ignore[arg-type]
            spend_usd=sum(r["cost_usd"] for r in fresh) if spend_usd is None else spend_usd,
            max_total_usd=max_total_usd,
            overshoot_usd=overshoot_usd,
            latency_p50_s=_percentile(latencies, 0.50),
            latency_p95_s=_percentile(latencies, 0.95),
            wall_s=wall_s,
        )

    def format(self) -> str:
        """A few human-readable lines (what the CLI prints)."""
        errors = ", ".join(f"{k}={v}" for k, v in self.errors_by_kind.items()) or "none"
        p50 = "-" if self.latency_p50_s is None else f"{self.latency_p50_s:.3f}s"
        p95 = "-" if self.latency_p95_s is None else f"{self.latency_p95_s:.3f}s"
        return (
            f"rows {self.n_rows}: ok {self.n_ok}, cache hits {self.n_cache_hits}, "
            f"calls {self.n_calls}, requests {self.n_requests} (retries {self.n_retries})\n"
            f"errors: {errors}\n"
            f"spend ${self.spend_usd:.6f} of ${self.max_total_usd:g} "
            f"(overshoot ${self.overshoot_usd:.6f}); latency p50 {p50}, p95 {p95}; "
            f"wall {self.wall_s:.2f}s"
        )
