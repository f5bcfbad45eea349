"""The glibc mmap threshold (applied, validated, it returns freed tensor memory) and
trimming the heap between phases (it returns them too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from composer_replication.model.cpu_allocator import ENV_VARIABLE, set_mmap_threshold

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"),
    reason="glibc-only behaviour",
)

# Frees 2 MiB blocks that were allocated between small long-lived ones (what a training
# step does with activations and gradients) and reports how much stayed resident.
_PROBE = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import time
    from composer_replication.model.cpu_allocator import (
        release_free_heap, set_mmap_threshold, trimming_heap
    )

    def rss():
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    applied = set_mmap_threshold() if sys.argv[1] == "fixed" else False
    torch.empty(4 << 20, dtype=torch.uint8).fill_(1)  # freeing it raises glibc's threshold
    before = rss()
    big, small = [], []
    for _ in range(64):
        big.append(torch.empty(2 << 20, dtype=torch.uint8).fill_(1))
        small.append(torch.empty(64 << 10, dtype=torch.uint8).fill_(1))
    del big
    released = release_free_heap() if sys.argv[1] == "trimmed" else False
    if sys.argv[1] == "background":  # the trimmer thread runs while the block waits
        with trimming_heap(0.05):
            time.sleep(0.5)
            released = True
    print(json.dumps({"applied": applied, "released": released, "kept": rss() - before}))
    """
)


def _kept(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != ENV_VARIABLE}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_fixed_threshold_returns_freed_blocks():
    dynamic, fixed = _kept("dynamic"), _kept("fixed")
    assert fixed["applied"] and not dynamic["applied"]
    # 64 x 2 MiB were freed: glibc's dynamic threshold keeps (nearly) all of it resident,
    # the fixed threshold keeps only the small live blocks (64 x 64 KiB = 4 MiB).
    assert dynamic["kept"] > 100 << 20
    assert fixed["kept"] < 16 << 20


@glibc
def test_trimming_the_heap_returns_freed_blocks():
    dynamic, trimmed = _kept("dynamic"), _kept("trimmed")
    assert trimmed["released"] and not dynamic["released"]
    assert dynamic["kept"] > 100 << 20
    assert trimmed["kept"] < 16 << 20  # the free pages between the live blocks went back


@glibc
def test_a_background_trimmer_returns_freed_blocks_while_a_block_runs():
    dynamic, background = _kept("dynamic"), _kept("background")
    assert dynamic["kept"] > 100 << 20
    assert background["kept"] < 16 << 20


@glibc
def test_trimming_heap_validation_and_off():
    from composer_replication.model.cpu_allocator import trimming_heap

    for bad in (0, -1.0):
        with pytest.raises(ValueError, match=f"every_s={bad}"), trimming_heap(bad):
            pass
    before = threading.active_count()
    with trimming_heap(None):  # off: no thread
        assert threading.active_count() == before
    with trimming_heap(10.0):  # on: one thread, gone when the block ends (not after 10 s)
        assert any(t.name == "heap-trimmer" for t in threading.enumerate())
    assert not any(t.name == "heap-trimmer" for t in threading.enumerate())


def test_threshold_validation_and_user_override(monkeypatch):
    with pytest.raises(ValueError, match="32 MiB"):
        set_mmap_threshold(64 << 20)
    with pytest.raises(ValueError, match="threshold_bytes=-1"):
        set_mmap_threshold(-1)
    monkeypatch.setenv(ENV_VARIABLE, "131072")
    assert set_mmap_threshold() is False  # the user's own setting wins
