"""benchmarks/gpu.py cannot rot: its CPU dry run prints every section's table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_benchmark_dry_run_on_the_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/gpu.py"),
            "--device",
            "cpu",
            "--quick",
            "--heldout",
            "0.05",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    for side in ("hf", "general", "static_eager", "static_graphs", "static_compiled"):
        assert results["sampling"]["batch_4"][side]["tokens_s"] > 0, side
    assert results["train"]["ours"]["tokens_s"] > 0 and results["train"]["plain"]["tokens_s"] > 0
    for recipe in ("default", "gpu"):
        steps = results["steps"][recipe]
        assert steps["sample_s"] > 0 and steps["train_s"] > 0, steps
        assert steps["sampled_tokens"] > 0
    heldout = results["heldout"]["composer"]
    assert heldout["steps"] >= 1 and heldout["greedy_before"] is not None, heldout
    for heading in (
        "Sampling, kept tokens/s",
        "Training, tokens/s",
        "Seconds per step",
        "Held-out pass@1",
    ):
        assert heading in proc.stdout
