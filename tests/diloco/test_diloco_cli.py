"""The `diloco` typer sub-app: launch (local executor, real processes), status, logs,
cancel through the state file, and what train_replica hands to `train`."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from composer_replication.diloco import cli as dcli


def echo_replica(config_uri: str, rendezvous_uri: str, world_size: int, overrides: list) -> None:
    """A stand-in trainer: read the uploaded config, average through the rendezvous."""
    import fsspec
    import torch

    from composer_replication.diloco.serverless.object_store import ObjectStoreAllReduce
    from composer_replication.diloco.serverless.replica_entrypoint import replica_rank

    rank = replica_rank(world_size)
    with fsspec.open(config_uri, "r") as fh:
        print("config:", fh.read().strip(), "overrides:", overrides)
    t = torch.tensor([float(rank)])
    ObjectStoreAllReduce(rendezvous_uri, rank, world_size, poll_interval_s=0.05).allreduce(t)
    print("mean:", t.item())


def slow_replica(**_: Any) -> None:
    time.sleep(60)


def test_launch_status_logs_cancel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    config = tmp_path / "run.toml"
    config.write_text("steps = 3\n")
    state = tmp_path / "state"
    runner = CliRunner()
    result = runner.invoke(
        dcli.diloco_app,
        [
            "launch",
            str(config),
            "--replicas",
            "2",
            "--run-id",
            "r1",
            "--state-dir",
            str(state),
            "--set",
            "steps=5",
            "--entrypoint",
            "test_diloco_cli.echo_replica",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "launched run r1: 2 replicas on local" in result.output
    recorded = json.loads((state / "r1.json").read_text())
    assert recorded["executor"] == "local" and len(recorded["handles"]) == 2
    assert recorded["rendezvous"] == (state / "r1" / "rendezvous").resolve().as_uri()
    deadline = time.monotonic() + 60
    while any(r["status"] == "running" for r in dcli.status("r1", state_dir=state)):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    out = runner.invoke(dcli.diloco_app, ["status", "r1", "--state-dir", str(state)]).output
    assert out.splitlines() == ["rank 0: succeeded", "rank 1: succeeded"]
    logs = dcli.logs("r1", state_dir=state)
    assert "config: steps = 3 overrides: ['steps=5']" in logs[0] and "mean: 0.5" in logs[1]
    out = runner.invoke(dcli.diloco_app, ["logs", "--rank", "1", "--state-dir", str(state)]).output
    assert out.startswith("===== rank 1 =====") and "mean: 0.5" in out

    result = runner.invoke(
        dcli.diloco_app,
        [
            "launch",
            str(config),
            "--replicas",
            "2",
            "--run-id",
            "r2",
            "--state-dir",
            str(state),
            "--entrypoint",
            "test_diloco_cli.slow_replica",
        ],
    )
    assert result.exit_code == 0, result.output
    assert [r["status"] for r in dcli.status(state_dir=state)] == ["running", "running"]
    out = runner.invoke(dcli.diloco_app, ["cancel", "--state-dir", str(state)]).output
    assert "cancelled 2 replicas" in out
    assert [r["status"] for r in dcli.status("r2", state_dir=state)] == ["cancelled"] * 2


def test_a_record_whose_pid_another_process_took_is_gone_and_never_signalled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    config = tmp_path / "run.toml"
    config.write_text("steps = 3\n")
    state = tmp_path / "state"
    dcli.launch(
        config, "local", 2, run_id="r3", state_dir=state, entrypoint="test_diloco_cli.echo_replica"
    )
    deadline = time.monotonic() + 60
    while any(r["status"] == "running" for r in dcli.status("r3", state_dir=state)):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    # the replica is long gone and an unrelated process (leading its own group) holds the
    # recorded pid: simulate the reuse by pointing the record at such a process
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        recorded = json.loads((state / "r3.json").read_text())
        meta = recorded["handles"][0]["metadata"]
        Path(meta["exit_path"]).unlink()  # no exit code left behind
        meta["pid"] = bystander.pid
        (state / "r3.json").write_text(json.dumps(recorded))
        assert [r["status"] for r in dcli.status("r3", state_dir=state)] == ["gone", "succeeded"]
        runner = CliRunner()
        out = runner.invoke(dcli.diloco_app, ["status", "r3", "--state-dir", str(state)]).output
        assert out.splitlines() == ["rank 0: gone", "rank 1: succeeded"]
        out = runner.invoke(dcli.diloco_app, ["cancel", "r3", "--state-dir", str(state)]).output
        assert out.strip() == "cancelled 0 replicas; left alone: rank 0 gone, rank 1 succeeded"
        # a record written before start ticks were kept is judged by its wall-clock start
        del meta["start_ticks"]
        meta["start_ts"] -= 3600
        (state / "r3.json").write_text(json.dumps(recorded))
        assert dcli.status("r3", state_dir=state)[0]["status"] == "gone"
        dcli.cancel("r3", state_dir=state)
        time.sleep(0.3)
        assert bystander.poll() is None  # never signalled
    finally:
        bystander.kill()
        bystander.wait()


def test_launch_errors(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text("")
    with pytest.raises(ValueError, match="--rendezvous is required"):
        dcli.launch(config, "eks", 2, state_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown executor 'slurm'"):
        dcli.launch(config, "slurm", 2, state_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="launch one first"):
        dcli.status(state_dir=tmp_path / "empty")
    assert dcli.parse_options(["image=x", "volume_size_gb=200"]) == {
        "image": "x",
        "volume_size_gb": 200,
    }
    with pytest.raises(ValueError, match="key=value"):
        dcli.parse_options(["image"])


def test_train_replica_trains_the_config_with_diloco_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import composer_replication.training.loop as loop
    from composer_replication.training.replica import train_replica

    config = tmp_path / "c.toml"
    config.write_text('steps = 2\noutput_dir = "runs/x"\n')
    seen = []
    monkeypatch.setattr(loop, "train", lambda cfg: seen.append(cfg))
    monkeypatch.setenv("REPLICA_RANK", "1")
    train_replica(config.as_uri(), "file:///rdv/allreduce", 2, ["steps=4"], {"anon": True})
    [cfg] = seen  # the library's train, called in this process: no CLI round trip
    assert cfg.steps == 4 and cfg.output_dir == "runs/x/rank_1"
    d = cfg.diloco
    assert (d.enabled, d.backend, d.rendezvous, d.world_size, d.rank) == (
        True,
        "object_store",
        "file:///rdv/allreduce",
        2,
        1,
    )
    assert d.storage_options == {"anon": True}
