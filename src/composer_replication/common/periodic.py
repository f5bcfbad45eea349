"""An action repeated from a daemon thread while a block runs (a heartbeat line, a heap
trim): the thread waits on an event, so it ends as soon as the block does."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

__all__ = ["periodically"]


@contextlib.contextmanager
def periodically(every_s: float, action: Callable[[], None], *, name: str) -> Iterator[None]:
    """Call ``action()`` every ``every_s`` seconds from a daemon thread named ``name`` while
    the block runs (not at its start or end); the thread is joined when the block ends."""
    done = threading.Event()

    def repeat() -> None:
        while not done.wait(every_s):
            action()

    thread = threading.Thread(target=repeat, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
