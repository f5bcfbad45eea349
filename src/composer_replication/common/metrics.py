"""Per-step metrics: one JSON row per step in ``metrics.jsonl``, plus optional trackers.

Rows are appended and fsynced one by one, so a killed run loses at most the row being
written; on resume, rows past the restored step are dropped so the file reads as if the
run had never stopped.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def peak_rss_gb() -> float:
    """This process's peak resident memory so far, in GB (10^9 bytes): the host side of a
    run's memory (model, activations on a CPU, decode caches), per step in the metrics."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1e9 if sys.platform == "darwin" else peak * 1024 / 1e9  # bytes / KiB


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON
    return value


class MetricsLog:
    """Append-only JSONL of step rows (each has an integer ``step``)."""

    def __init__(
        self, path: str | Path, trackers: Iterable[str] = (), run_name: str = "run"
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._trackers = [_make_tracker(name, self.path.parent, run_name) for name in trackers]

    def append(self, row: dict[str, Any]) -> None:
        if "step" not in row:
            raise ValueError("a metrics row needs a 'step'")
        line = json.dumps({k: _clean(v) for k, v in row.items()}, sort_keys=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        for tracker in self._trackers:
            tracker(row)

    def rows(self) -> list[dict[str, Any]]:
        return read_rows(self.path)

    def truncate_after(self, step: int) -> None:
        """Keep only rows with ``step <= step`` (atomic rewrite). A line that is not a row
        (the half-written one of a run killed mid-write) is set aside in
        ``<file>.torn``, said in a warning, never dropped silently."""
        kept = [r for r in self.rows() if int(r["step"]) <= step]
        torn = _torn_lines(self.path)
        if torn:
            aside = self.path.with_name(self.path.name + ".torn")
            with open(aside, "a", encoding="utf-8") as fh:
                fh.write("".join(line + "\n" for line in torn))
            log.warning(
                "%s: %d line(s) that are not whole rows (a run killed while writing one) set "
                "aside in %s; their steps after step %d are trained again",
                self.path,
                len(torn),
                aside,
                step,
            )
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        os.replace(tmp, self.path)


class MemoryMetricsLog:
    """:class:`MetricsLog`'s interface kept in memory: the rows of a rank that writes no
    files (under data parallelism only rank 0 writes ``metrics.jsonl``)."""

    def __init__(self) -> None:
        self._rows: list[dict[str, Any]] = []

    def append(self, row: dict[str, Any]) -> None:
        if "step" not in row:
            raise ValueError("a metrics row needs a 'step'")
        self._rows.append({k: _clean(v) for k, v in row.items()})

    def rows(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._rows]

    def truncate_after(self, step: int) -> None:
        self._rows = [r for r in self._rows if int(r["step"]) <= step]


def _torn_lines(path: Path) -> list[str]:
    """The lines of a metrics file that are not JSON rows."""
    if not path.exists():
        return []
    torn = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            json.loads(line)
        except json.JSONDecodeError:
            torn.append(line)
    return torn


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a metrics file; a torn last line (killed mid-write) is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _make_tracker(name: str, log_dir: Path, run_name: str):
    def numeric(row):
        return {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}

    if name == "tensorboard":
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise RuntimeError("tracker 'tensorboard' needs: pip install tensorboard") from err
        writer = SummaryWriter(log_dir=str(log_dir / "tensorboard"))

        def log_tb(row: dict[str, Any]) -> None:
            for key, value in numeric(row).items():
                writer.add_scalar(key, value, int(row["step"]))
            writer.flush()

        return log_tb
    if name == "wandb":
        try:
            import wandb
        except ImportError as err:
            raise RuntimeError("tracker 'wandb' needs: pip install wandb") from err
        run = wandb.init(project="composer-replication", name=run_name, dir=str(log_dir))
        return lambda row: run.log(numeric(row), step=int(row["step"]))
    if name == "trackio":
        try:
            import trackio
        except ImportError as err:
            raise RuntimeError("tracker 'trackio' needs: pip install trackio") from err
        trackio.init(project="composer-replication", name=run_name)
        return lambda row: trackio.log(numeric(row))
    raise ValueError(f"unknown tracker {name!r}; choose tensorboard, wandb or trackio")
