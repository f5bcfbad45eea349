"""DifficultyCurriculum: EMA values, band weights, rounds, deterministic sampling, state."""

from __future__ import annotations

import json
import random
from collections import Counter
from functools import partial

import pytest

from composer_replication.envs.curriculum import DifficultyCurriculum
from composer_replication.safety.holdout import HeldoutLeakError, HeldoutSplit

IDS = ["easy", "hard", "mid", "new"]

# toy ids of no environment: a pool without a held-out part
ToyCurriculum = partial(DifficultyCurriculum, split=None)


def _curriculum(**kwargs: object) -> DifficultyCurriculum:
    cur = ToyCurriculum(IDS, **kwargs)  # type: ignore[arg-type]
    cur.update(0, {"easy": [1, 1, 1, 1], "hard": [0, 0, 0, 0], "mid": [1, 0, 1, 0]})
    return cur


def test_first_result_seeds_then_ema_with_weight_on_prior() -> None:
    cur = ToyCurriculum(["t"], ema_alpha=0.75)
    assert cur.pass_rate("t") is None
    cur.update(0, {"t": [True, False, True, True]})
    assert cur.pass_rate("t") == 0.75
    cur.update(1, {"t": 0.25})
    assert cur.pass_rate("t") == 0.75 * 0.75 + 0.25 * 0.25  # 0.625, exact in binary
    cur.update(5, {})  # rounds may skip indices; tasks without results keep their EMA
    assert cur.pass_rate("t") == 0.625


def test_weights_favour_the_learnable_band() -> None:
    cur = _curriculum()
    assert cur.weights() == {"easy": 0.01, "hard": 0.01, "mid": 0.25, "new": 0.25}
    assert cur.in_band() == ["mid"]
    cur.update(1, {"mid": 1.0})  # EMA 0.75 -> weight 0.75 * 0.25
    assert cur.weight("mid") == 0.1875


def test_band_edges_are_inclusive_and_configurable() -> None:
    cur = ToyCurriculum(["a", "b"], band=(0.25, 0.5), ema_alpha=0.0, outside_weight=0.0)
    cur.update(0, {"a": 0.25, "b": 0.75})
    assert cur.weights() == {"a": 0.1875, "b": 0.0}


def test_update_twice_for_a_round_is_an_error() -> None:
    cur = _curriculum()
    with pytest.raises(ValueError, match="already applied round 0; got round 0"):
        cur.update(0, {"mid": 1.0})
    with pytest.raises(ValueError, match="strictly increasing"):
        cur.update(-1, {"mid": 1.0})
    assert cur.pass_rate("mid") == 0.5  # nothing was applied


@pytest.mark.parametrize(
    ("results", "match"),
    [
        ({"ghost": 1.0}, "unknown task ids"),
        ({"mid": 1.5}, r"must be in \[0, 1\]"),
        ({"mid": []}, "are empty"),
        ({"mid": float("nan")}, r"must be in \[0, 1\]"),
    ],
)
def test_update_rejects_bad_results(results: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ToyCurriculum(IDS).update(0, results)


def test_sampling_is_deterministic_given_a_seed_or_generator() -> None:
    cur = _curriculum()
    assert cur.sample(3, seed=7) == cur.sample(3, seed=7)
    assert cur.sample(3, rng=random.Random(7)) == cur.sample(3, seed=7)
    draws = {tuple(cur.sample(2, seed=s)) for s in range(20)}
    assert len(draws) > 1


def test_sampling_frequencies_follow_the_weights() -> None:
    cur = _curriculum(outside_weight=0.0)
    counts = Counter(cur.sample(20_000, seed=0, replace=True))
    assert set(counts) == {"mid", "new"}  # out-of-band tasks are never drawn
    assert abs(counts["mid"] / 20_000 - 0.5) < 0.02  # equal weights 0.25 and 0.25


def test_without_replacement_draws_distinct_positive_weight_tasks() -> None:
    cur = _curriculum(outside_weight=0.0)
    assert sorted(cur.sample(2, seed=3)) == ["mid", "new"]
    with pytest.raises(ValueError, match="only 2 have weight > 0"):
        cur.sample(3, seed=3)


def test_all_zero_weights_fall_back_to_uniform() -> None:
    cur = ToyCurriculum(["a", "b"], unseen_weight=0.0)
    assert sorted(cur.sample(2, seed=1)) == ["a", "b"]


def test_state_dict_is_json_and_restores_sampling() -> None:
    cur = _curriculum()
    state = json.loads(json.dumps(cur.state_dict()))
    fresh = ToyCurriculum()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == cur.state_dict()
    assert fresh.sample(3, seed=11) == cur.sample(3, seed=11)
    with pytest.raises(ValueError, match="already applied round 0"):
        fresh.update(0, {"mid": 1.0})
    assert state["tasks"]["mid"] == {"ema": 0.5, "rounds": 1}


def test_load_state_dict_checks_version_and_settings() -> None:
    state = _curriculum().state_dict()
    with pytest.raises(ValueError, match="saved with settings"):
        ToyCurriculum(band=(0.1, 0.9)).load_state_dict(state)
    with pytest.raises(ValueError, match="unsupported curriculum state version"):
        ToyCurriculum().load_state_dict({**state, "version": 99})


def test_held_out_ids_are_refused_everywhere() -> None:
    split = HeldoutSplit(heldout_fraction=0.5, salt="curriculum-tests")
    ids = [f"task-{i}" for i in range(20)]
    held = next(t for t in ids if split.is_heldout(t))
    train = [t for t in ids if not split.is_heldout(t)]
    with pytest.raises(HeldoutLeakError):
        ToyCurriculum([*train, held], split=split)
    cur = ToyCurriculum(train, split=split)
    with pytest.raises(HeldoutLeakError):
        cur.add_tasks([held])
    with pytest.raises(HeldoutLeakError):
        cur.update(0, {held: 1.0})
    leaked = ToyCurriculum([held]).state_dict()
    with pytest.raises(HeldoutLeakError):
        ToyCurriculum(split=split).load_state_dict(leaked)


def test_invalid_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="band must satisfy"):
        ToyCurriculum(band=(0.9, 0.1))
    with pytest.raises(ValueError, match="ema_alpha"):
        ToyCurriculum(ema_alpha=1.0)
    with pytest.raises(ValueError, match="weights must be >= 0"):
        ToyCurriculum(outside_weight=-1)
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        ToyCurriculum(["a"]).sample(-1)


def test_the_projects_split_is_in_force_by_default():
    from composer_replication.safety.holdout import DEFAULT_SPLIT

    held = next(t for t in (f"task-{i}" for i in range(100)) if DEFAULT_SPLIT.is_heldout(t))
    with pytest.raises(HeldoutLeakError, match=held):
        DifficultyCurriculum([held])
    assert DifficultyCurriculum([held], split=None).weights()[held] > 0  # explicitly no split
