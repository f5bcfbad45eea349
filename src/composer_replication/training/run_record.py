"""A run directory holds one run: a new run started where a previous one wrote moves that
run's record aside first.

Without it, a second ``train`` into the same ``output_dir`` (``make run`` twice) appends its
metrics rows to the first run's, its report plots both as one, and a later ``--resume``
can pick up the previous run's newest checkpoint. Nothing is deleted: the previous record
goes to ``previous/<UTC time>/`` inside the run directory.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["PREVIOUS_DIR", "RUN_RECORD", "holds_a_run", "set_aside_previous_run"]

#: What a run writes into its directory (trackers' folders and an engine's files excepted:
#: those are open while the run starts).
RUN_RECORD = (
    "config.json",
    "metrics.jsonl",
    "summary.json",
    "report",
    "final_model",
    "checkpoints",
    "rollouts",
)
#: Where previous runs' records go, inside the run directory.
PREVIOUS_DIR = "previous"


def holds_a_run(run_dir: str | os.PathLike[str]) -> bool:
    """Whether ``run_dir`` holds what a run produced (rows, checkpoints, a model or a
    summary); a lone ``config.json`` of a run that failed before its first row does not count."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        return True
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        return True
    return (run_dir / "final_model").exists() or (run_dir / "summary.json").exists()


def set_aside_previous_run(run_dir: str | os.PathLike[str]) -> Path | None:
    """Move the record of a previous run out of ``run_dir`` (each entry of
    :data:`RUN_RECORD` renamed into ``previous/<UTC time>/``); the folder it went to, or
    None when ``run_dir`` held no run. Renames stay on one filesystem, so nothing is copied."""
    run_dir = Path(run_dir)
    if not holds_a_run(run_dir):
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = run_dir / PREVIOUS_DIR / stamp
    n = 1
    while target.exists():  # two fresh starts within one second
        n += 1
        target = run_dir / PREVIOUS_DIR / f"{stamp}-{n}"
    target.mkdir(parents=True)
    for name in RUN_RECORD:
        if (run_dir / name).exists():
            os.replace(run_dir / name, target / name)
    return target
