"""The shared run lifecycle: the hack tripwire stops a run whose rollouts keep gaming the
grader, and its state survives a checkpoint."""

from __future__ import annotations

import pytest

from composer_replication.config import RunConfig
from composer_replication.training.lifecycle import RunLifecycle


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

    from composer_replication.model.loading import tiny_policy
    from composer_replication.safety import CollapseStopError

    life = _life(tmp_path, hack_fraction_stop=0.1, hack_patience=1)
    life.hack_round(1, {"hack/flagged_fraction": 1.0})
    model, tokenizer = tiny_policy(seed=0)
    with pytest.raises(CollapseStopError, match="hack flags"):
        life.finish(model, tokenizer, steps=1)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_by_guard"].startswith("hack flags")
    assert (tmp_path / "run" / "final_model" / "config.json").is_file()


def test_heldout_evaluation_reports_flagged_attempts_beside_pass_at_1(tmp_path):
    from composer_replication.samples.rollouts import Rollout
    from composer_replication.training.lifecycle import HeldoutTasks

    class FlaggingEnv:
        def rollouts(self, policy, tokenizer, ids, *, group_size, sampling):
            forged = Rollout("a", [1], [2], [0.0], reward=0.0)
            forged.metadata["hack_flags"] = ["forged report: unknown id"]
            solved = Rollout("b", [1], [2], [0.0], reward=1.0)
            broken = Rollout("c", [1], [2], [0.0], reward=0.0)
            broken.metadata["infrastructure_error"] = True  # says nothing: left out
            return [[forged, solved, broken]]

    life = _life(tmp_path)
    assert life.evaluate(None, None, [HeldoutTasks(FlaggingEnv(), ["a"], 8)]) == 0.5
    assert life.heldout_hack_fraction == 0.5
    row: dict = {"reward/mean": 0.0}
    life.guard_round(1, row, 0.5)
    assert row["heldout/hack_flagged_fraction"] == 0.5


class _TemperatureEnv:
    """Held-out answers by temperature: greedy solves task a only; sampling solves a in 2
    of 4 attempts and b in 1 of 4 (one more attempt of b never ran)."""

    def __init__(self):
        self.temperatures = []

    def rollouts(self, policy, tokenizer, ids, *, group_size, sampling):
        from composer_replication.samples.rollouts import Rollout

        self.temperatures.append(sampling.temperature)

        def attempt(tid, reward, broken=False):
            r = Rollout(tid, [1], [2], [0.0], reward=reward)
            if broken:
                r.metadata["infrastructure_error"] = True
            return r

        if sampling.temperature == 0:
            assert group_size == 1
            return [[attempt("a", 1.0)], [attempt("b", 0.5)]]
        assert group_size == 4
        return [
            [attempt("a", r) for r in (1.0, 0.0, 1.0, 0.5)],
            [*(attempt("b", r) for r in (0.0, 1.0, 0.0, 0.0)), attempt("b", 1.0, broken=True)],
        ]


def test_heldout_evaluation_adds_pass_at_k_and_greedy_pass_at_1(tmp_path):
    from composer_replication.training.lifecycle import HeldoutTasks

    env = _TemperatureEnv()
    life = _life(tmp_path)
    assert life.config.eval.samples_per_task == 4
    tasks = [HeldoutTasks(env, ["a", "b"], 8)]
    life.evaluate_start(None, None, tasks)
    assert env.temperatures == [1.0, 0.0]  # sampled, then one greedy pass
    assert life.heldout_before == pytest.approx(3 / 8)  # pooled share, as before
    row = life.metrics.rows()[0]
    assert row["heldout/pass@1"] == pytest.approx(3 / 8)
    # unbiased pass@4 per task: a: 1 - C(2,4)/C(4,4) = 1; b: 1 - C(3,4)/C(4,4) = 1
    assert row["heldout/pass@4"] == pytest.approx(1.0)
    assert row["heldout/greedy_pass@1"] == pytest.approx(0.5)
    later: dict = {"reward/mean": 0.0}
    life.guard_round(6, later, life.evaluate(None, None, tasks))
    assert later["heldout/pass@4"] == 1.0 and later["heldout/greedy_pass@1"] == 0.5


def test_greedy_off_adds_no_generation_pass(tmp_path):
    from composer_replication.training.lifecycle import HeldoutTasks

    env = _TemperatureEnv()
    life = _life(tmp_path)
    assert life.config.eval.greedy is True  # on by default: the headline number
    life.config = life.config.model_copy(
        update={"eval": life.config.eval.model_copy(update={"greedy": False})}
    )
    life.evaluate_start(None, None, [HeldoutTasks(env, ["a", "b"], 8)])
    assert env.temperatures == [1.0]
    row = life.metrics.rows()[0]
    assert "heldout/greedy_pass@1" not in row and row["heldout/pass@4"] == pytest.approx(1.0)
