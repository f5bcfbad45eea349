"""Resuming cuts metrics.jsonl back to the checkpoint's step; a half-written row is set
aside and said, never dropped silently."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from composer_replication.common.metrics import MetricsLog


def test_a_torn_row_is_set_aside_with_a_warning_when_the_run_resumes(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for step in (1, 2, 3):
        log.append({"step": step, "loss": float(step)})
    with open(path, "a", encoding="utf-8") as fh:
        fh.write('{"step": 4, "loss": 0.')  # killed mid-write
    with caplog.at_level(logging.WARNING):
        log.truncate_after(2)
    assert [r["step"] for r in log.rows()] == [1, 2]
    assert (tmp_path / "metrics.jsonl.torn").read_text() == '{"step": 4, "loss": 0.\n'
    assert (
        "1 line(s) that are not whole rows" in caplog.text and "metrics.jsonl.torn" in caplog.text
    )
    assert all(json.loads(line) for line in path.read_text().splitlines())
    caplog.clear()
    log.truncate_after(2)  # nothing torn now: nothing said
    assert "not whole rows" not in caplog.text


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc")
def test_peak_rss_is_the_kernels_high_water_mark():
    from composer_replication.common.metrics import peak_rss_gb

    block = bytearray(64 * 2**20)  # touched: resident
    block[::4096] = b"x" * len(block[::4096])
    status = Path("/proc/self/status").read_text()
    line = next(row for row in status.splitlines() if row.startswith("VmHWM:"))
    high_water_kb = int(line.split()[1])
    assert abs(peak_rss_gb() - high_water_kb * 1024 / 1e9) < 0.01
    assert peak_rss_gb() >= len(block) / 1e9
