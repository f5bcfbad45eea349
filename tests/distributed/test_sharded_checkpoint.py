"""Sharded checkpoints (torch.distributed.checkpoint) written by 2 gloo ranks: loaded back
into 2 freshly sharded ranks and into one plain process, they hold exactly the state that
was saved."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from composer_replication.training.checkpoint import SHARDED_DIR, CheckpointManager

WORKER = Path(__file__).with_name("ckpt_worker.py")
pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _run_ranks(tmp_path: Path, mode: str) -> Path:
    from test_data_parallel import _finish, _free_port

    out = tmp_path / "run"
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), "2", str(port), mode, str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    for code, err in _finish(procs):
        assert code == 0, err[-3000:]
    return out


def _assert_same_state(got: dict, want: dict) -> None:
    assert got["params"].keys() == want["params"].keys()
    for name, value in want["params"].items():
        assert torch.equal(got["params"][name], value), name
    assert got["optim"].keys() == want["optim"].keys()
    for name, moments in want["optim"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(got["optim"][name][key]), moments[key]), name


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_two_ranks_write_shards_that_load_on_two_ranks_and_in_one_process(tmp_path, mode):
    sys.path.insert(0, str(WORKER.parent))
    out = _run_ranks(tmp_path, mode)
    manager = CheckpointManager(out, keep_last=1)
    assert manager.steps() == [1]
    path = manager.latest()
    # each rank wrote its own shard file; no whole copy of the weights exists
    files = sorted(p.name for p in (path / SHARDED_DIR).iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (path / "trainable.safetensors").exists()
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]  # committed, no leftovers
    whole = torch.load(out / "whole.pt")
    saved = whole["saved"]
    assert any(m["exp_avg"].abs().sum() > 0 for m in saved["optim"].values())  # not vacuous
    _assert_same_state(whole["loaded"], saved)  # 2 ranks -> 2 fresh ranks
    for rank in (0, 1):  # every rank got its own random-number stream back
        rng = torch.load(out / f"rng.rank{rank}.pt")
        assert torch.equal(rng["got"], rng["expected"])
    # 2 ranks -> one plain process
    from dp_worker import build_policy
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    policy = build_policy(mode == "lora")
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad])
    manager.load(path, model=policy, optimizer=optimizer, scheduler=None)
    options = StateDictOptions(full_state_dict=True)
    one = {
        "params": {n: p.detach() for n, p in policy.named_parameters() if p.requires_grad},
        "optim": get_optimizer_state_dict(policy, optimizer, options=options)["state"],
    }
    _assert_same_state(one, saved)
    # the rank-0 RNG stream in one process
    assert torch.equal(torch.rand(3), torch.load(out / "rng.rank0.pt")["expected"])


def test_a_checkpoint_written_with_another_lora_setting_is_refused(tmp_path):
    sys.path.insert(0, str(WORKER.parent))
    out = _run_ranks(tmp_path, "lora")
    from dp_worker import build_policy

    policy = build_policy(False)  # full fine-tune: other trainable parameters
    optimizer = torch.optim.AdamW(policy.parameters())
    manager = CheckpointManager(out)
    with pytest.raises(ValueError, match="another LoRA setting"):
        manager.load(manager.latest(), model=policy, optimizer=optimizer, scheduler=None)
