"""The trl backend under ``accelerate launch`` with the same TOML: two CPU processes (DDP over
gloo) split every step's tasks, train one model, and rank 0 alone writes the run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from composer_replication.backends.trl.run import (
    grpo_config_from_run,
    launched_processes,
    tasks_per_process,
)
from composer_replication.config import RunConfig

RUN_TOML = """
seed = 7
steps = 2
output_dir = "{out}"
[model]
source = "{model}"
[eval]
every = 2
max_tasks = 6
samples_per_task = 2
[[envs]]
name = "python_functions"
tasks_per_step = {tasks}
[envs.algorithm.sampling]
group_size = 2
max_new_tokens = 16
[envs.algorithm.advantage]
type = "sdpo"
"""


def _config(tmp_path: Path, tasks: int = 2, name: str = "run") -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(RUN_TOML.format(out=tmp_path / name, model=tmp_path / "tiny", tasks=tasks))
    return path


def test_each_process_takes_an_equal_share_of_the_steps_tasks(tmp_path, monkeypatch):
    assert tasks_per_process(4, 2) == 2 and tasks_per_process(3, 1) == 3
    with pytest.raises(ValueError, match=r"tasks_per_step = 4 does not split over 3 processes"):
        tasks_per_process(4, 3)
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert launched_processes() == 3
    cfg = RunConfig.from_toml(_config(tmp_path, tasks=4))
    with pytest.raises(ValueError, match=r"tasks_per_step = 4 does not split over 3 processes"):
        grpo_config_from_run(cfg, tmp_path)  # refused before any process group is joined
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two' is not a process count"):
        launched_processes()
    monkeypatch.delenv("WORLD_SIZE")
    assert launched_processes() == 1
    assert grpo_config_from_run(cfg, tmp_path).per_device_train_batch_size == 4 * 2


def _launch(tmp_path: Path, config: Path, processes: int) -> subprocess.CompletedProcess:
    accelerate = Path(sys.executable).with_name("accelerate")
    launcher = (
        [str(accelerate), "launch", "--multi_gpu", "--num_processes", str(processes)]
        if processes > 1
        else [str(accelerate), "launch", "--cpu", "--num_processes", "1"]
    )
    command = [
        *launcher,
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "-m", "composer_replication.cli", "train", str(config), "--backend", "trl",
    ]  # fmt: skip
    return subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False
    )


def _num_tokens(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["num_tokens"] for r in rows if r["step"] > 0]


@pytest.mark.slow
@pytest.mark.integration
def test_accelerate_launch_two_processes_trains_one_run(tmp_path):
    if (
        shutil.which("accelerate") is None
        and not Path(sys.executable).with_name("accelerate").exists()
    ):
        pytest.skip("the accelerate launcher is not installed beside this interpreter")
    from composer_replication.model.loading import save_checkpoint, tiny_policy

    model, tokenizer = tiny_policy(seed=0)
    save_checkpoint(model, tmp_path / "tiny", tokenizer=tokenizer)
    initial = load_file(tmp_path / "tiny" / "model.safetensors")

    two = _launch(tmp_path, _config(tmp_path, name="two"), processes=2)
    assert two.returncode == 0, two.stderr[-3000:]
    one = _launch(tmp_path, _config(tmp_path, name="one"), processes=1)
    assert one.returncode == 0, one.stderr[-3000:]

    run = tmp_path / "two"
    assert two.stdout.count("train (trl backend)") == 1  # rank 1 stays quiet
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # one row per step, written once
    assert rows[0]["heldout/pass@1"] == 0.0 and rows[2]["heldout/pass@1"] == 0.0
    assert all(r["loss"] > 0 for r in rows[1:])  # the SDPO term trained
    assert rows[2]["kl/to_init"] > 0  # measured on both processes' rollouts, summed
    # the same TOML means the same global batch: tokens per step equal one process's
    assert _num_tokens(run) == _num_tokens(tmp_path / "one")
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["backend"], summary["steps"]) == ("trl", 2)
    trained = load_file(run / "final_model" / "model.safetensors")
    moved = [k for k in initial if k in trained and not torch.equal(initial[k], trained[k])]
    assert moved, "the final model equals the initial one: nothing was trained"
