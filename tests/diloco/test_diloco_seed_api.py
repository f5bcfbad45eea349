"""The seed's DiLoCo surface: its module paths, its trainer calling convention, torchft's
quorum/commit bookkeeping on the object-store manager, and results from local replicas."""

from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from composer_replication.diloco.serverless import replica_entrypoint as rep
from composer_replication.diloco.serverless.manager import (
    CompletedWork,
    ObjectStoreManager,
    QuorumNotStartedError,
)
from composer_replication.diloco.serverless.object_store import ObjectStoreAllReduce


def seed_style_train(manager: Any, rank: int, world_size: int, scale: float = 1.0) -> dict:
    """The seed's trainer signature: the manager, then the placement."""
    t = torch.tensor([float(rank + 1)]) * scale
    manager.allreduce(t).wait()
    return {"rank": rank, "world_size": world_size, "mean": t.item()}


def manager_only_train(manager: Any, tag: str) -> str:
    return f"{tag}:{manager.rank}/{manager.num_participants}"


def kwargs_train(manager: Any, **kwargs: Any) -> dict:
    return dict(kwargs)


def seven() -> int:
    return 7


def tensor_result_train(manager: Any, rank: int) -> torch.Tensor:
    return torch.tensor([rank])


@pytest.mark.parametrize(
    ("module", "name", "target_module", "target_name"),
    [
        ("diloco.serverless.executor", "ReplicaHandle", "diloco.serverless.base", None),
        ("diloco.serverless.executor", "ServerlessExecutor", "diloco.serverless.base", None),
        ("diloco.serverless.executor", "LocalProcessExecutor", "diloco.serverless.local", None),
        (
            "diloco.serverless.allreduce",
            "ObjectStoreAllReduce",
            "diloco.serverless.object_store",
            None,
        ),
        (
            "diloco.serverless.allreduce",
            "MockManager",
            "diloco.serverless.manager",
            "ObjectStoreManager",
        ),
        (
            "diloco.serverless.allreduce",
            "_ImmediateWork",
            "diloco.serverless.manager",
            "CompletedWork",
        ),
        ("diloco", "_DummyWork", "diloco.serverless.manager", "CompletedWork"),
        ("traces.replaysim", "DPOPair", "traces.teacher_replay.records", None),
        ("traces.replaysim", "TeacherCallResult", "traces.teacher_replay.records", None),
        ("traces.replaysim", "extract_dpo_pairs", "traces.teacher_replay.pairs", None),
        ("traces.replaysim", "replay_trace", "traces.teacher_replay.replay", None),
        ("replaysim", "replay_trace", "traces.teacher_replay.replay", None),
    ],
)
def test_seed_module_paths_are_the_real_objects(module, name, target_module, target_name):
    alias = getattr(importlib.import_module(f"composer_replication.{module}"), name)
    target = importlib.import_module(f"composer_replication.{target_module}")
    assert alias is getattr(target, target_name or name)


def test_seed_names_of_the_completed_work_behave_as_work():
    from composer_replication.diloco import _DummyWork
    from composer_replication.diloco.serverless.allreduce import _ImmediateWork

    t = torch.tensor([1.0, 2.0])
    for cls in (_DummyWork, _ImmediateWork):
        work = cls(t)
        assert work.wait() is True and work.is_completed()
        assert work.get_future().wait() is t


def test_dj_normalizer_default_recipe_is_a_class_attribute():
    from composer_replication.traces.replaysim import normalize
    from composer_replication.traces.replaysim.normalize import DJNormalizer

    assert DJNormalizer.DEFAULT_RECIPE == normalize.DEFAULT_RECIPE
    assert DJNormalizer.DEFAULT_RECIPE.is_file()
    assert DJNormalizer(skip_dj=True).recipe_path == DJNormalizer.DEFAULT_RECIPE

    class Custom(DJNormalizer):
        DEFAULT_RECIPE = Path("/nonexistent/recipe.yaml")

    # a subclass's class attribute is the default it uses (and is checked like one)
    with pytest.raises(FileNotFoundError, match=r"/nonexistent/recipe\.yaml"):
        Custom()


def _main(tmp_path, monkeypatch, fn, **kwargs):
    monkeypatch.setenv("REPLICA_RANK", "0")
    return rep.main(str(tmp_path / "rdv"), 1, __name__, fn, kwargs, poll_interval_s=0.01)


def test_entrypoint_passes_rank_and_world_size_to_a_seed_style_trainer(tmp_path, monkeypatch):
    got = _main(tmp_path, monkeypatch, "seed_style_train", scale=2.0)
    assert got == {"rank": 0, "world_size": 1, "mean": 2.0}
    # **kwargs trainers get them too; trainers that take neither are called without them
    assert _main(tmp_path, monkeypatch, "kwargs_train", x=1) == {
        "x": 1,
        "rank": 0,
        "world_size": 1,
    }
    assert _main(tmp_path, monkeypatch, "manager_only_train", tag="t") == "t:0/1"
    with pytest.raises(ValueError, match=r"trainer_kwargs set \['rank'\]"):
        _main(tmp_path, monkeypatch, "seed_style_train", rank=3)


def test_manager_quorum_and_commit_follow_torchft(tmp_path):
    manager = ObjectStoreManager(ObjectStoreAllReduce(str(tmp_path), 0, 2))
    # before any quorum: torchft asserts in wait_quorum
    assert manager.participating_rank() is None
    with pytest.raises(QuorumNotStartedError, match="start_quorum before wait_quorum"):
        manager.wait_quorum()
    with pytest.raises(AssertionError):  # torchft-style callers catch AssertionError
        manager.wait_quorum()
    # the documented surface: start_quorum() bumps the step, wait_quorum() -> int (the size)
    assert manager.start_quorum() is None
    assert manager.current_step() == 1
    assert manager.wait_quorum() == 2
    assert manager.participating_rank() == 0
    # num_participants: the seed's int attribute and torchft's method
    assert manager.num_participants == 2 and manager.num_participants() == 2
    assert (manager.current_step(), manager.batches_committed()) == (1, 0)
    assert manager.should_commit() is True
    assert (manager.current_step(), manager.batches_committed()) == (1, 2)
    # an error reported during a step: no commit, the step is taken back and retried
    manager.start_quorum()
    assert manager.current_step() == 2
    boom = RuntimeError("allreduce failed")
    manager.report_error(boom)
    assert manager.errored() is boom
    assert manager.state_dict()["step"] == 1  # an open step is not checkpointed
    assert manager.should_commit() is False
    assert (manager.current_step(), manager.batches_committed()) == (1, 2)
    assert manager.should_commit() is False  # still errored; nothing taken back twice
    assert manager.current_step() == 1
    manager.start_quorum(allow_heal=False, shrink_only=True, timeout=5)
    assert manager.errored() is None and manager.current_step() == 2
    assert manager.should_commit() is True
    assert manager.should_commit() is True  # a second call commits nothing more
    assert (manager.current_step(), manager.batches_committed()) == (2, 4)
    # the bookkeeping is checkpointed and restored
    state = manager.state_dict()
    restored = ObjectStoreManager(ObjectStoreAllReduce(str(tmp_path / "other"), 0, 2))
    restored.load_state_dict(state)
    assert (restored.current_step(), restored.batches_committed()) == (2, 4)


@pytest.mark.integration
def test_local_executor_collect_returns_each_replica_result(tmp_path):
    from composer_replication.diloco.serverless import LocalProcessExecutor

    here = str(Path(__file__).parent)
    executor = LocalProcessExecutor(tmp_path / "work", env={"PYTHONPATH": here})
    args = {
        "rendezvous_uri": str(tmp_path / "rdv"),
        "world_size": 2,
        "trainer_module": __name__,
        "trainer_fn": "seed_style_train",
        "trainer_kwargs": {"scale": 3.0},
        "poll_interval_s": 0.05,
    }
    entry = "composer_replication.diloco.serverless.replica_entrypoint"
    handles = executor.launch_replicas(2, entry, args)
    rows = executor.collect(handles, timeout=120)
    logs = [executor.stream_logs(h) for h in handles]
    assert [r["status"] for r in rows] == ["succeeded", "succeeded"], logs
    # (1 + 2) / 2 * 3 averaged across the two replicas
    assert [r["result"] for r in rows] == [
        {"rank": 0, "world_size": 2, "mean": 4.5},
        {"rank": 1, "world_size": 2, "mean": 4.5},
    ]
    assert [r["result_kind"] for r in rows] == ["json", "json"]
    # a result JSON cannot hold comes back as its repr
    args = {**args, "rendezvous_uri": str(tmp_path / "rdv2"), "trainer_fn": "tensor_result_train"}
    args.pop("trainer_kwargs")
    rows = executor.collect(executor.launch_replicas(2, entry, args), timeout=120)
    assert [(r["result_kind"], r["result"]) for r in rows] == [
        ("repr", "tensor([0])"),
        ("repr", "tensor([1])"),
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the warning on a machine without GPU")
def test_local_executor_warns_when_a_gpu_is_requested_without_one(tmp_path):
    from composer_replication.diloco.serverless import LocalProcessExecutor

    executor = LocalProcessExecutor(
        tmp_path / "work", env={"PYTHONPATH": str(Path(__file__).parent)}
    )
    with pytest.warns(UserWarning, match=r"gpu='A100' was requested but this machine has no"):
        handles = executor.launch_replicas(1, f"{__name__}.seven", {}, gpu="A100")
    # it still runs (on the CPU) and its result comes back
    assert executor.collect(handles, timeout=60)[0]["result"] == 7
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handles = executor.launch_replicas(1, f"{__name__}.seven", {}, gpu=None)
    assert executor.collect(handles, timeout=60)[0]["result"] == 7


def test_runner_result_file_round_trip(tmp_path):
    from composer_replication.diloco.serverless.runner import read_result, write_result

    path = str(tmp_path / "r.json")
    write_result(path, {"a": [1, 2]})
    assert read_result(path) == ("json", {"a": [1, 2]})
    write_result(path, float("nan"))
    assert read_result(path) == ("repr", "nan")
    assert read_result(tmp_path / "missing.json") == (None, None)
    assert json.loads(Path(path).read_text())["kind"] == "repr"
    assert CompletedWork(torch.ones(1)).is_completed()


@pytest.mark.integration
def test_local_executor_documented_example(tmp_path, monkeypatch):
    from composer_replication.diloco.serverless import LocalProcessExecutor

    # the documented call; "my.trainer" is this module, "/tmp/run/" a fresh folder
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    ex = LocalProcessExecutor()
    assert ex.backend_name == "local_process"
    handles = ex.launch_replicas(
        n_replicas=2,
        entrypoint="composer_replication.diloco.serverless.replica_entrypoint",
        entrypoint_args={
            "rendezvous_uri": str(tmp_path / "run") + "/",
            "world_size": 2,
            "trainer_module": __name__,
            "trainer_fn": "seed_style_train",
        },
    )
    assert all(h.backend_name == "local_process" for h in handles)
    assert all(isinstance(h.metadata["start_ts"], float) for h in handles)
    assert {"pid", "start_ts"} <= set(handles[0].metadata)
    results = ex.collect(handles, timeout=60)
    assert [r["result"]["mean"] for r in results] == [1.5, 1.5]
    # entrypoint="" is the same default entry point; world_size defaults to n_replicas
    handles = ex.launch_replicas(
        n_replicas=2,
        entrypoint="",
        entrypoint_args={
            "rendezvous_uri": str(tmp_path / "run2"),
            "trainer_module": __name__,
            "trainer_fn": "seed_style_train",
        },
    )
    rows = ex.collect(handles, timeout=60)
    assert [r["result"]["world_size"] for r in rows] == [2, 2], [r["error"] for r in rows]


def test_mock_manager_documented_surface(tmp_path):
    from composer_replication.diloco.serverless import MockManager, ObjectStoreAllReduce

    store = ObjectStoreAllReduce(str(tmp_path) + "/", rank=0, world_size=2)
    mgr = MockManager(store)
    assert (mgr._step, mgr.current_step()) == (0, 0)
    assert mgr.start_quorum() is None
    assert (mgr._step, mgr.current_step()) == (1, 1)  # start_quorum() bumps _step
    quorum = mgr.wait_quorum()
    assert type(quorum) is int and quorum == 2 == mgr.num_participants
    assert mgr.should_commit() is True
    assert mgr.is_leader() and mgr._use_async_quorum is False
    mgr.start_quorum()
    assert mgr.current_step() == 2
