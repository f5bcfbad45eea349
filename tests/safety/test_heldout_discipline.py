"""Held-out discipline through the public API: a split is in force by default wherever a
task id is known, and every training or task-generation boundary refuses held-out ids."""

from __future__ import annotations

import pytest

from composer_replication.safety.holdout import (
    DEFAULT_SPLIT,
    HeldoutLeakError,
    HeldoutSplit,
    HeldoutSplitMismatch,
    check_same_split,
)

IDS = [f"task-{i}" for i in range(200)]
HELD = next(t for t in IDS if DEFAULT_SPLIT.is_heldout(t))
TRAIN = next(t for t in IDS if not DEFAULT_SPLIT.is_heldout(t))


def _fd_task(task_id: str):
    from composer_replication.envs.fd_tasks import FDTask

    return FDTask(
        task_id=task_id,
        repo="r",
        file="m.py",
        qualname="f",
        prompt="restore f",
        target_tests=("tests/test_m.py::test_f",),
        passing_tests=("tests/test_m.py::test_f",),
        files=("m.py",),
        workdir="/nonexistent",
        test_command="python -m pytest -q",
    )


def test_write_tasks_refuses_held_out_ids_by_default(tmp_path):
    from composer_replication.envs.fd_tasks import read_jsonl_records, write_tasks

    out = tmp_path / "tasks.jsonl"
    with pytest.raises(HeldoutLeakError, match=HELD):
        write_tasks(out, [_fd_task(TRAIN), _fd_task(HELD)])
    assert not out.exists()  # nothing written
    write_tasks(out, [_fd_task(TRAIN)])
    assert [r["task_id"] for r in read_jsonl_records(out)] == [TRAIN]
    write_tasks(out, [_fd_task(HELD)], split=None)  # explicitly a pool without held-out part
    assert [r["task_id"] for r in read_jsonl_records(out)] == [HELD]


def test_pack_samples_refuses_held_out_samples_by_default_and_under_a_runs_split():
    from composer_replication.samples.wire import TrainingSample, pack_samples

    def sample(task_id):
        return TrainingSample(
            [1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], advantages=[0.0, 1.0, 1.0], task_id=task_id
        )

    with pytest.raises(HeldoutLeakError, match=HELD):
        pack_samples([sample(TRAIN), sample(HELD)], max_tokens=64)
    assert len(pack_samples([sample(TRAIN), sample("")], max_tokens=64)) == 1
    own = HeldoutSplit(0.5, "run-salt")
    held_by_run = next(t for t in IDS if own.is_heldout(t))
    with pytest.raises(HeldoutLeakError, match=held_by_run):
        pack_samples([sample(held_by_run)], max_tokens=64, split=own)
    assert pack_samples([sample(HELD)], max_tokens=64, split=None)


def test_the_collator_refuses_traces_of_held_out_tasks():
    from composer_replication.backends.trl.data_collator import (
        CollatorConfig,
        ComposerDataCollator,
        TraceExample,
    )
    from composer_replication.model.loading import load_tokenizer

    def trace(task_id):
        return {
            "trace_id": f"t-{task_id}",
            "task_id": task_id,
            "turns": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
            "final_reward": 1.0,
        }

    assert TraceExample.from_dict(trace(HELD)).task_id == HELD
    collate = ComposerDataCollator(load_tokenizer())
    with pytest.raises(HeldoutLeakError, match=HELD):
        collate([trace(TRAIN), trace(HELD)])
    assert collate([trace(TRAIN)])["input_ids"].shape[0] == 1
    free = ComposerDataCollator(load_tokenizer(), CollatorConfig(split=None))
    assert free([trace(HELD)])["input_ids"].shape[0] == 1


def test_a_user_dataset_with_held_out_tasks_is_refused_before_trl_starts():
    from datasets import Dataset

    from composer_replication.backends.trl.trainer import ComposerReplicationTrainer

    data = Dataset.from_dict({"prompt": ["a", "b"], "task_id": [TRAIN, HELD]})
    with pytest.raises(HeldoutLeakError, match=HELD):
        ComposerReplicationTrainer(model=None, train_dataset=data)
    own = HeldoutSplit(0.5, "run-salt")
    held_by_run = next(t for t in IDS if own.is_heldout(t))
    with pytest.raises(HeldoutLeakError, match=held_by_run):
        ComposerReplicationTrainer(
            model=None, train_dataset=Dataset.from_dict({"task_id": [held_by_run]}), split=own
        )


def test_split_records_round_trip_and_mismatches_name_the_fix(tmp_path):
    from composer_replication.envs.fd_tasks import read_split_record, write_split_record

    out = tmp_path / "tasks.jsonl"
    assert read_split_record(out) is None
    path = write_split_record(out, HeldoutSplit(0.3, "s"))
    assert path.name == "tasks.split.json"
    assert read_split_record(out) == HeldoutSplit(0.3, "s")
    check_same_split(HeldoutSplit(0.3, "s"), HeldoutSplit(0.3, "s"), "x")
    with pytest.raises(
        HeldoutSplitMismatch, match=r"set heldout_fraction = 0.3 and heldout_salt = 's'"
    ):
        check_same_split(HeldoutSplit(0.3, "s"), DEFAULT_SPLIT, "tasks.jsonl")
    path.write_text('{"heldout_fraction": 0.3}')
    with pytest.raises(ValueError, match=r"tasks\.split\.json: expected"):
        read_split_record(out)
