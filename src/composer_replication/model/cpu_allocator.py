"""Keep a CPU training process's resident memory close to what its tensors actually use.

PyTorch allocates CPU tensors with the C library's ``malloc``. glibc serves blocks below its
mmap threshold from heap arenas and, after the first large block is freed, raises that
threshold dynamically up to 32 MiB. A training step then allocates and frees thousands of
activation-sized blocks (1-32 MiB) interleaved with long-lived ones (gradients, optimizer
state); the freed blocks stay resident because live blocks sit above them in the heap.
Measured on SmolLM2-135M (8 x 512 tokens, activation checkpointing): 2.84 GiB of peak
extra RSS with glibc's defaults, 1.22 GiB with a fixed 256 KiB threshold, for the same
tensors. A fixed threshold hands every large block its own mapping, returned to the
system the moment it is freed; the price is a fresh page fault on every page of every
large allocation (about 3.4 s more per step of the LoRA loop measured in
``benchmarks/trl_vs_native.py``), so runs leave it off unless ``malloc_mmap_threshold`` is
set. Memory benchmarks use it to count live tensors instead of the heap's leftovers.

Between phases of a run (after a learner update, around an evaluation) the loop instead
hands the heap's free pages back with ``malloc_trim`` (:func:`release_free_heap`): the
next phase faults its pages in once, not once per allocation, and the leftovers of one
phase no longer add to the next phase's peak.

Inside a phase the heap still fills with holes: an agent's episodes keep each row's keys
and values (blocks of 0.3-1 MiB per layer) between turns while the decode allocates and
frees larger blocks around them, so the holes cannot go back to the system and the
process grows past what its tensors hold. :func:`trimming_heap` hands the free pages back
every few seconds from a background thread while a block runs (measured on an agent's
held-out evaluation: peak RSS 5.0-5.7 GB with glibc's defaults, 4.1 GB trimmed every
3 s, for the same answers).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Iterator

from composer_replication.common.periodic import periodically

# glibc's mallopt parameter number (malloc.h).
_M_MMAP_THRESHOLD = -3
ENV_VARIABLE = "MALLOC_MMAP_THRESHOLD_"
DEFAULT_MMAP_THRESHOLD = 256 * 1024
#: Seconds between two trims of :func:`trimming_heap` in a CPU run (``malloc_trim_every_s``)
#: and a CPU evaluation: a trim of a multi-GB heap takes milliseconds.
TRIM_EVERY_S = 3.0


def set_mmap_threshold(threshold_bytes: int = DEFAULT_MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold for this process; True when it was applied.

    Does nothing (returns False) off Linux/glibc, or when the user already chose a value
    through the ``MALLOC_MMAP_THRESHOLD_`` environment variable (theirs wins).

    Raises:
        ValueError: for a threshold outside glibc's accepted range (0 .. 32 MiB).
    """
    if not 0 <= threshold_bytes <= 32 * 1024 * 1024:
        raise ValueError(
            f"threshold_bytes={threshold_bytes} is outside 0 .. 33554432 (32 MiB), the range "
            "glibc accepts for M_MMAP_THRESHOLD"
        )
    if not sys.platform.startswith("linux") or ENV_VARIABLE in os.environ:
        return False
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(threshold_bytes)))


def release_free_heap() -> bool:
    """Return the free pages of every glibc heap arena to the system (``malloc_trim(0)``);
    True when any memory was released. Does nothing (False) off Linux/glibc."""
    if not sys.platform.startswith("linux"):
        return False
    libc = _glibc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    return bool(libc.malloc_trim(ctypes.c_size_t(0)))


@contextlib.contextmanager
def trimming_heap(every_s: float | None) -> Iterator[None]:
    """While the block runs, a daemon thread hands the heap's free pages back to the system
    every ``every_s`` seconds (:func:`release_free_heap`; glibc locks each arena while it
    trims, so it is safe beside the allocating threads). None: nothing is started, as off
    Linux/glibc.

    Raises:
        ValueError: for ``every_s`` <= 0.
    """
    if every_s is not None and not every_s > 0:
        raise ValueError(f"every_s={every_s} must be > 0 seconds (or None: no trimming)")
    if every_s is None or not sys.platform.startswith("linux") or _glibc() is None:
        yield
        return
    with periodically(every_s, release_free_heap, name="heap-trimmer"):
        yield


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (looked up once: ``find_library`` runs ``ldconfig``)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return None  # musl and others: no glibc heap to tune
    return libc
