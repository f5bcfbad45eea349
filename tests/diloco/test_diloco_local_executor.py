"""LocalProcessExecutor end to end with real processes, replica_entrypoint, the runner."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from composer_replication.diloco.serverless import (
    LocalProcessExecutor,
    ReplicaHandle,
    ServerlessExecutor,
)
from composer_replication.diloco.serverless import replica_entrypoint as rep
from composer_replication.diloco.serverless.base import resolve_entrypoint


def average_trainer(manager: Any, out_dir: str, values: list[float]) -> None:
    """A replica 'trainer': average a rank-dependent tensor through the manager's store."""
    rank = manager.rank
    t = torch.tensor(values) * (rank + 1)
    manager.allreduce(t).wait()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(t.tolist()))
    print(f"rank {rank} of {manager.num_participants} done")


def sleeper(seconds: float) -> None:
    time.sleep(seconds)


def failer() -> None:
    raise ValueError("boom from the replica")


def test_local_executor_satisfies_the_protocol() -> None:
    assert isinstance(LocalProcessExecutor(), ServerlessExecutor)


@pytest.mark.integration
def test_two_local_replicas_average_a_tensor(tmp_path: Path) -> None:
    # the trainer lives in this test module: its folder must be importable in the replicas
    here = str(Path(__file__).parent)
    executor = LocalProcessExecutor(tmp_path / "work", env={"PYTHONPATH": here})
    args = {
        "rendezvous_uri": (tmp_path / "rdv").as_uri(),
        "world_size": 2,
        "trainer_module": __name__,
        "trainer_fn": "average_trainer",
        "trainer_kwargs": {"out_dir": str(tmp_path), "values": [1.0, 2.0, 4.0]},
        "poll_interval_s": 0.05,
    }
    handles = executor.launch_replicas(
        2, "composer_replication.diloco.serverless.replica_entrypoint", args
    )
    assert [h.rank for h in handles] == [0, 1]
    rows = executor.collect(handles, timeout=120)
    assert [(r["rank"], r["status"], r["exit_code"]) for r in rows] == [
        (0, "succeeded", 0),
        (1, "succeeded", 0),
    ], [executor.stream_logs(h) for h in handles]
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [1.5, 3.0, 6.0]
    assert "rank 1 of 2 done" in executor.stream_logs(handles[1])
    # status from another executor instance (as `diloco status` does) reads the exit files
    other = LocalProcessExecutor(tmp_path / "work")
    assert other.poll(handles[0]) == "succeeded"


def test_callable_entrypoint_rank_env_failure_and_cancel(tmp_path: Path) -> None:
    executor = LocalProcessExecutor(tmp_path)
    [failed] = executor.launch_replicas(1, failer, {})
    [slow] = executor.launch_replicas(1, sleeper, {"seconds": 60})
    rows = executor.collect([failed], timeout=60)
    assert rows[0]["status"] == "failed" and rows[0]["exit_code"] == 1
    assert "boom from the replica" in rows[0]["error"]
    assert executor.poll(slow) == "running"
    executor.cancel(slow)
    assert executor.poll(slow) == "cancelled"


def test_rank_env_names_the_variable(tmp_path: Path) -> None:
    executor = LocalProcessExecutor(tmp_path)
    handles = executor.launch_replicas(
        2, "os.getcwd", {"rank_env": "MY_RANK"}, timeout=60
    )  # a trivial module.function entrypoint
    assert [r["status"] for r in executor.collect(handles, timeout=60)] == ["succeeded"] * 2


def test_launch_timeout_is_a_hard_deadline(tmp_path: Path) -> None:
    executor = LocalProcessExecutor(tmp_path)
    [h] = executor.launch_replicas(1, sleeper, {"seconds": 60}, timeout=1)
    time.sleep(1.2)
    assert executor.poll(h) == "cancelled"


def test_bad_launch_arguments(tmp_path: Path) -> None:
    executor = LocalProcessExecutor(tmp_path)
    with pytest.raises(ValueError, match="n_replicas"):
        executor.launch_replicas(0, sleeper, {})
    with pytest.raises(ValueError, match=r"pass 'module\.function' instead"):
        executor.launch_replicas(1, lambda: None, {})


def test_resolve_entrypoint_forms() -> None:
    assert resolve_entrypoint("composer_replication.diloco.serverless.replica_entrypoint") is (
        rep.main
    )
    assert resolve_entrypoint("os.path.join") is os.path.join
    assert resolve_entrypoint(sleeper) is sleeper
    with pytest.raises(ValueError, match="no callable 'nope'"):
        resolve_entrypoint("os.nope")


def test_handle_round_trips_through_json() -> None:
    h = ReplicaHandle(3, "eks", {"job_name": "j"})
    assert ReplicaHandle.from_dict(json.loads(json.dumps(h.to_dict()))) == h
    assert ReplicaHandle(0, "local").metadata == {}


def test_replica_entrypoint_rank_errors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("REPLICA_RANK", raising=False)
    with pytest.raises(RuntimeError, match="REPLICA_RANK is not set"):
        rep.main(str(tmp_path), 2, __name__, "average_trainer")
    monkeypatch.setenv("REPLICA_RANK", "2")
    with pytest.raises(ValueError, match="out of range for world_size=2"):
        rep.main(str(tmp_path), 2, __name__, "average_trainer")


def test_replica_entrypoint_cli_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("REPLICA_RANK", "0")
    code = rep.cli(
        [
            "--rendezvous",
            str(tmp_path / "rdv"),
            "--world-size",
            "1",
            "--trainer-module",
            __name__,
            "--trainer-fn",
            "average_trainer",
            "--trainer-kwargs-json",
            json.dumps({"out_dir": str(tmp_path), "values": [2.0]}),
        ]
    )
    assert code == 0
    assert json.loads((tmp_path / "rank0.json").read_text()) == [2.0]
