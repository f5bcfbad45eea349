"""The report draws agent episodes when a run has them (and only then)."""

from __future__ import annotations

import json
from pathlib import Path

from composer_replication.training.report import AGENT_PANELS, plotted_series, write_report


def _run(tmp_path: Path, rows: list[dict]) -> Path:
    run = tmp_path / "run"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_agent_plots_appear_for_agent_runs_only(tmp_path: Path):
    agent_rows = [
        {"step": 0, "heldout/pass@1": 0.0, "heldout/agent/turns_mean": 1.0,
         "heldout/agent/end/truncated": 1.0, "heldout/agent/parse_failure_rate": 0.0},
        {"step": 1, "reward/mean": 0.2, "agent/turns_mean": 3.5, "agent/tool_calls_mean": 3.0,
         "agent/parse_failure_rate": 0.25, "agent/end/finish": 0.75, "agent/end/answer": 0.25},
        {"step": 2, "reward/mean": 0.4, "heldout/pass@1": 0.2, "heldout/agent/turns_mean": 4.0,
         "heldout/agent/end/finish": 1.0, "heldout/agent/parse_failure_rate": 0.0},
    ]  # fmt: skip
    out = write_report(_run(tmp_path, agent_rows))
    assert {p.name for p in out.glob("*.png")} == {
        "rewards.png", "kl.png", "losses.png", "agent.png", "agent_ends.png",
    }  # fmt: skip
    ends = next(keys for name, _, keys in AGENT_PANELS if name == "agent_ends.png")
    assert plotted_series(agent_rows, ends) == [
        "agent/end/finish", "agent/end/answer", "heldout/agent/end/finish",
        "heldout/agent/end/truncated",
    ]  # fmt: skip
    summary = (out / "summary.md").read_text()
    assert "| heldout/agent/parse_failure_rate | 0.0000 | 0.0000 | 0.0000 |" in summary
    plain = write_report(_run(tmp_path / "plain", [{"step": 1, "reward/mean": 0.5, "loss": 1.0}]))
    assert {p.name for p in plain.glob("*.png")} == {"rewards.png", "kl.png", "losses.png"}
