"""Progress of long work on a console that is not a terminal (a pipe, a log file).

A terminal shows a run's bars and spinners; a log shows nothing until the work ends, and a
user watching it cannot tell a slow evaluation from a hung one. :func:`heartbeat` writes a
plain line at least every ``HEARTBEAT_S`` seconds while its block runs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from composer_replication.common.periodic import periodically

__all__ = ["HEARTBEAT_S", "heartbeat"]

#: the most seconds a console that is not a terminal waits for a line during long work
HEARTBEAT_S = 30.0


@contextlib.contextmanager
def heartbeat(
    console: Any, what: str, *, every: float = HEARTBEAT_S, announce: bool = True
) -> Iterator[None]:
    """Long work without its own progress lines (an evaluation, making tasks): on a console
    that is not a terminal (a pipe, a log file) a line when it starts (``announce``) and
    then one at least every ``every`` seconds until it ends, so a log never looks stuck;
    nothing on a terminal (its bars and spinners show progress) or without a console. Work
    that is not announced and ends within ``every`` seconds prints nothing."""
    if console is None or console.is_terminal:
        yield
        return
    started = time.monotonic()
    beats = []

    def beat() -> None:
        elapsed = time.monotonic() - started
        console.print(f"{what}: {elapsed:.0f} s so far", markup=False, highlight=False)
        beats.append(elapsed)

    if announce:
        console.print(f"{what} ...", markup=False, highlight=False)
    try:
        with periodically(every, beat, name="heartbeat"):
            yield
    finally:
        if announce or beats:
            elapsed = time.monotonic() - started
            console.print(f"{what}: done in {elapsed:.0f} s", markup=False, highlight=False)
