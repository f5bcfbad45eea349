"""A new run in a directory that holds a previous run moves that run's record aside, whole;
a resumed run keeps its own."""

from __future__ import annotations

import json
from pathlib import Path

from composer_replication.config import RunConfig
from composer_replication.training.lifecycle import RunLifecycle
from composer_replication.training.run_record import (
    PREVIOUS_DIR,
    holds_a_run,
    set_aside_previous_run,
)


def _fill(run_dir: Path) -> None:
    (run_dir / "checkpoints" / "step_000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_000002" / "state.pt").write_bytes(b"x")
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    (run_dir / "config.json").write_text('{"seed": 1}')
    (run_dir / "summary.json").write_text("{}")
    (run_dir / "report").mkdir()
    (run_dir / "notes.txt").write_text("mine")  # not part of a run's record


def test_what_counts_as_a_previous_run(tmp_path):
    assert not holds_a_run(tmp_path / "missing")
    assert not holds_a_run(tmp_path)
    (tmp_path / "config.json").write_text("{}")  # a start that failed before any row
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "checkpoints").mkdir()
    assert not holds_a_run(tmp_path)
    assert set_aside_previous_run(tmp_path) is None
    assert (tmp_path / "config.json").exists()
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    assert holds_a_run(tmp_path)


def test_the_whole_record_moves_and_two_starts_get_two_folders(tmp_path):
    _fill(tmp_path)
    first = set_aside_previous_run(tmp_path)
    assert first is not None and first.parent == tmp_path / PREVIOUS_DIR
    assert sorted(p.name for p in first.iterdir()) == [
        "checkpoints",
        "config.json",
        "metrics.jsonl",
        "report",
        "summary.json",
    ]
    assert (first / "checkpoints" / "step_000002" / "state.pt").read_bytes() == b"x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", PREVIOUS_DIR]
    assert set_aside_previous_run(tmp_path) is None  # nothing left to move
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')  # the next run's first row
    second = set_aside_previous_run(tmp_path)
    assert second is not None and second != first and first.exists()


def test_begin_writes_the_config_and_moves_only_for_a_new_run(tmp_path):
    run_dir = tmp_path / "run"
    cfg = RunConfig.default([f"output_dir={run_dir}", "seed=7"])
    run_dir.mkdir()
    _fill(run_dir)
    life = RunLifecycle(cfg, backend="native")
    assert life.begin(resumed=True) is None  # a resumed run keeps its rows and checkpoints
    assert (run_dir / "metrics.jsonl").exists() and (run_dir / "checkpoints").exists()
    assert json.loads((run_dir / "config.json").read_text())["seed"] == 7
    moved = life.begin(resumed=False)
    assert moved is not None
    assert json.loads((moved / "config.json").read_text())["seed"] == 7
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()
    assert json.loads((run_dir / "config.json").read_text())["seed"] == 7
