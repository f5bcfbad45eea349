"""The shared run lifecycle: the hack tripwire stops a run whose rollouts keep gaming the
grader, and its state survives a checkpoint."""

from __future__ import annotations

import pytest

from composer_replication.config import RunConfig
from composer_replication.trainer.lifecycle import RunLifecycle


def _life(tmp_path, **guard):
    cfg = RunConfig.default([f"output_dir={tmp_path / 'run'}"])
    cfg = cfg.model_copy(update={"guard": cfg.guard.model_copy(update=guard)})
    return RunLifecycle(cfg, backend="native")


def test_hack_tripwire_fires_after_patience_steps_over_the_limit(tmp_path):
    life = _life(tmp_path, hack_fraction_stop=0.25, hack_patience=3)
    shares = [0.5, 0.5, 0.1, 0.3, 0.4]  # the 0.1 resets the streak
    fired = [
        life.hack_round(step, {"hack/flagged_fraction": s}) for step, s in enumerate(shares, 1)
    ]
    assert fired == [False] * 5
    row = {"hack/flagged_fraction": 0.9}
    assert life.hack_round(6, row) is True
    assert row["guard/fired"] is True and "hack flags on 90%" in row["guard/reason"]
    assert life.stopped is not None and life.stopped.step == 6


def test_hack_tripwire_off_and_state_round_trip(tmp_path):
    off = _life(tmp_path, hack_fraction_stop=None)
    assert not any(off.hack_round(s, {"hack/flagged_fraction": 1.0}) for s in range(1, 10))
    life = _life(tmp_path, hack_fraction_stop=0.2, hack_patience=2)
    life.hack_round(1, {"hack/flagged_fraction": 0.5})
    state = life.state_dict()
    again = _life(tmp_path, hack_fraction_stop=0.2, hack_patience=2)
    again.load_state_dict(state, step=1)
    assert again.hack_round(2, {"hack/flagged_fraction": 0.5}) is True


def test_finish_raises_after_writing_model_and_summary(tmp_path):
    import json

    from composer_replication.models import tiny_policy
    from composer_replication.safety import CollapseStopError

    life = _life(tmp_path, hack_fraction_stop=0.1, hack_patience=1)
    life.hack_round(1, {"hack/flagged_fraction": 1.0})
    model, tokenizer = tiny_policy(seed=0)
    with pytest.raises(CollapseStopError, match="hack flags"):
        life.finish(model, tokenizer, steps=1)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_by_guard"].startswith("hack flags")
    assert (tmp_path / "run" / "final_model" / "config.json").is_file()
