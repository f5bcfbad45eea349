"""Tests for `composer_replication.safety.holdout.HeldoutSplit` and `HeldoutLeakError`."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import subprocess
import sys

import pytest

from composer_replication.safety import HeldoutLeakError, HeldoutSplit

IDS = [f"task-{i}" for i in range(1000)]

# Golden membership for the default split: changing the hash would silently move tasks
# between train and held-out in every existing project, so it is pinned here.
GOLDEN_HELDOUT_OF_FIRST_30 = [
    "task-2",
    "task-4",
    "task-6",
    "task-7",
    "task-10",
    "task-17",
    "task-21",
]


def _reference_bucket(salt: str, task_id: str) -> float:
    digest = hashlib.sha256((salt + "\x00" + task_id).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def test_defaults_are_a_run_configs_defaults() -> None:
    from composer_replication.config import RunConfig

    s = HeldoutSplit()
    assert (s.heldout_fraction, s.salt) == (0.25, "composer-replication")
    run = RunConfig()
    assert (run.heldout_fraction, run.heldout_salt) == (s.heldout_fraction, s.salt)


def test_bucket_matches_reference_sha256() -> None:
    s = HeldoutSplit(0.3, salt="abc")
    for t in IDS[:200]:
        assert s.bucket(t) == _reference_bucket("abc", t)
        assert s.is_heldout(t) == (_reference_bucket("abc", t) < 0.3)


def test_golden_membership_is_stable() -> None:
    s = HeldoutSplit(0.2)
    assert s.heldout_ids([f"task-{i}" for i in range(30)]) == GOLDEN_HELDOUT_OF_FIRST_30


def test_split_is_disjoint_covering_and_order_preserving() -> None:
    s = HeldoutSplit()
    train, heldout = s.split(IDS)
    assert set(train).isdisjoint(heldout)
    assert sorted(train + heldout) == sorted(IDS)
    assert train == [t for t in IDS if not s.is_heldout(t)]
    assert heldout == [t for t in IDS if s.is_heldout(t)]
    assert s.train_ids(IDS) == train
    assert s.heldout_ids(IDS) == heldout
    assert s.filter_trainable(IDS) == train


def test_split_keeps_duplicates_and_accepts_generators() -> None:
    s = HeldoutSplit()
    ids = ["task-2", "task-0", "task-2", "task-0"]  # task-2 held out, task-0 train
    assert s.split(iter(ids)) == (["task-0", "task-0"], ["task-2", "task-2"])
    assert s.split([]) == ([], [])


def test_split_is_the_same_in_another_process() -> None:
    code = (
        "import json; from composer_replication.safety import HeldoutSplit; "
        "print(json.dumps(HeldoutSplit(0.25, 'x').heldout_ids([f'task-{i}' for i in range(1000)])))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # Python's hash() would differ
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert json.loads(out.stdout) == HeldoutSplit(0.25, "x").heldout_ids(IDS)


@pytest.mark.parametrize("fraction", [0.05, 0.2, 0.5, 0.9])
def test_fraction_is_respected_over_10000_ids(fraction: float) -> None:
    ids = [f"repo/{i}" for i in range(10_000)]
    share = len(HeldoutSplit(fraction).heldout_ids(ids)) / len(ids)
    # binomial std at n=10,000 is at most 0.005; 0.02 is four standard deviations
    assert abs(share - fraction) < 0.02


def test_different_salt_gives_a_different_split() -> None:
    a = HeldoutSplit(salt="composer-replication").heldout_ids(IDS)
    b = HeldoutSplit(salt="another-project").heldout_ids(IDS)
    assert a != b
    assert len(set(a) & set(b)) < len(a) // 2  # close to independent, not a shifted copy


def test_raising_the_fraction_only_moves_tasks_into_heldout() -> None:
    small = set(HeldoutSplit(0.1).heldout_ids(IDS))
    large = set(HeldoutSplit(0.3).heldout_ids(IDS))
    assert small < large


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5, math.nan, True, "0.2"])
def test_invalid_fraction_raises(fraction: object) -> None:
    with pytest.raises(ValueError, match="heldout_fraction must be a number with 0 < fraction < 1"):
        HeldoutSplit(fraction)  # type: ignore[arg-type]


def test_invalid_salt_and_ids_raise_type_error() -> None:
    with pytest.raises(TypeError, match="salt must be a str"):
        HeldoutSplit(salt=1)  # type: ignore[arg-type]
    s = HeldoutSplit()
    with pytest.raises(TypeError, match="task ids must be str, got 7"):
        s.is_heldout(7)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="single string 'task-1'"):
        s.split("task-1")
    with pytest.raises(TypeError, match="single string"):
        s.check_trainable("task-1")


def test_split_is_frozen() -> None:
    s = HeldoutSplit()
    with pytest.raises(AttributeError):
        s.heldout_fraction = 0.5  # type: ignore[misc]


def test_check_trainable_passes_clean_ids() -> None:
    s = HeldoutSplit()
    train = s.train_ids(IDS)
    assert s.check_trainable(iter(train)) == train
    for t in train[:20]:
        assert s.assert_trainable(t) is None


def test_check_trainable_refuses_heldout_ids() -> None:
    s = HeldoutSplit()
    with pytest.raises(HeldoutLeakError) as info:
        s.check_trainable(["task-0", "task-2", "task-1", "task-4"])
    err = info.value
    assert isinstance(err, ValueError)
    assert err.task_ids == ["task-2", "task-4"]
    assert str(err).startswith(
        "held-out task ids 'task-2', 'task-4' passed to a training or task-generation path; "
        "held-out tasks may only be used for evaluation."
    )


def test_assert_trainable_refuses_a_heldout_id() -> None:
    with pytest.raises(HeldoutLeakError, match="held-out task id 'task-2' passed") as info:
        HeldoutSplit().assert_trainable("task-2")
    assert info.value.task_ids == ["task-2"]
    assert "may only be used for evaluation" in str(info.value)


def test_leak_error_message_truncates_long_lists_and_pickles() -> None:
    heldout = HeldoutSplit().heldout_ids(IDS)
    with pytest.raises(HeldoutLeakError) as info:
        HeldoutSplit().check_trainable(IDS)
    err = info.value
    assert err.task_ids == heldout
    assert f"and {len(heldout) - 10} more" in str(err)
    assert repr(heldout[9]) in str(err)
    assert repr(heldout[10]) + "," not in str(err)
    back = pickle.loads(pickle.dumps(err))
    assert (back.task_ids, str(back)) == (err.task_ids, str(err))
