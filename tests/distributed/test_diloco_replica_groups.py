"""DiLoCo whose replicas are FSDP2 groups: every rank runs the outer loop on its own shards
(shard r of each replica meets the others under its own prefix). Two inner updates and two
outer steps give the same weights whether a replica is one process or two sharded ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("diloco_worker.py")
pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _run(tmp_path: Path, replicas: int, shards: int) -> list[dict]:
    from test_data_parallel import _finish, _free_port

    store = f"file://{tmp_path / f'store_{replicas}x{shards}'}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs, outs = [], []
    for replica in range(replicas):
        port = _free_port()
        out = tmp_path / f"r{replica}_of_{replicas}x{shards}.pt"
        outs.append(out)
        for shard in range(shards):
            args = [replica, replicas, shard, shards, port, store, out]
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), *map(str, args)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
    for code, err in _finish(procs):
        assert code == 0, err[-3000:]
    return [torch.load(out) for out in outs]


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_replica_of_two_sharded_ranks_equals_a_one_process_replica(tmp_path, replicas):
    sys.path.insert(0, str(WORKER.parent))
    whole = _run(tmp_path, replicas, shards=1)  # replicas x 1 rank
    sharded = _run(tmp_path, replicas, shards=2)  # replicas x 2 ranks
    from composer_replication.model.loading import tiny_model

    start = dict(tiny_model(seed=0).named_parameters())
    for replica in range(replicas):
        assert sharded[replica].keys() == whole[replica].keys()
        for name, value in whole[replica].items():
            assert torch.allclose(sharded[replica][name], value, atol=1e-6, rtol=0), name
        # replicas agree after every outer step
        for name, value in whole[0].items():
            assert torch.equal(whole[replica][name], value), name
    moved = max((whole[0][n] - start[n].detach()).abs().max().item() for n in start)
    assert moved > 1e-3  # the outer steps changed the weights (not vacuous)


def test_train_with_two_ranks_per_diloco_replica(tmp_path):
    """`train --nproc 2` with DiLoCo on: one replica of two FSDP2 ranks runs its outer
    steps and checkpoints each rank's own outer state."""
    sys.path.insert(0, str(WORKER.parent))
    from test_data_parallel import _run_config, train_on_two_ranks

    from composer_replication.model.loading import save_checkpoint, tiny_policy

    model, tok = tiny_policy(seed=0)
    toml = _run_config(tmp_path, str(save_checkpoint(model, tmp_path / "tiny", tokenizer=tok)))
    store = tmp_path / "store"
    toml.write_text(
        toml.read_text()
        + f"""
[diloco]
enabled = true
backend = "object_store"
sync_every = 1
world_size = 1
rank = 0
rendezvous = "file://{store}"
poll_interval_s = 0.05
"""
    )
    train_on_two_ranks(toml)
    import json

    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["diloco/synced"] for row in rows if "diloco/synced" in row] == [1.0, 1.0]
    # each shard met its own prefix of the store
    assert sorted(p.name for p in store.iterdir()) == ["shard_0000_of_0002", "shard_0001_of_0002"]
    state = torch.load(run / "checkpoints" / "step_000002" / "state.pt", weights_only=False)
    per_rank = state["extra"]["diloco_per_rank"]
    assert [part["outer_steps"] for part in per_rank] == [2, 2]
    sizes = [part["outer"].numel() for part in per_rank]
    trainable = sum(p.numel() for p in tiny_lora_params(tmp_path))
    assert sum(sizes) >= trainable and max(sizes) < trainable  # each rank holds a shard


def tiny_lora_params(tmp_path):
    """The trainable (LoRA) parameters the run config builds."""
    from composer_replication.config.run import RunConfig
    from composer_replication.training.setup import setup_policy

    config = RunConfig.from_toml((tmp_path / "run.toml").read_text())
    policy, _ = setup_policy(config.model)
    return [p for p in policy.parameters() if p.requires_grad]
