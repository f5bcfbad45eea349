"""``composer-replication train --placement monarch`` (formerly ``--engine``): the real embedded
model, one short step."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from typer.testing import CliRunner

pytest.importorskip("monarch.actor")

from composer_replication.cli import app
from composer_replication.config import RunConfig


@pytest.mark.parametrize("flag", ["--placement", "--engine"])
def test_an_unknown_placement_is_a_usage_error(tmp_path, flag):
    result = CliRunner().invoke(app, ["train", flag, "ray", "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 2
    assert "unknown placement 'ray' of the roles" in result.output
    assert not (tmp_path / "run").exists()


def test_the_old_and_new_flags_must_agree(tmp_path):
    argv = ["train", "--engine", "monarch", "--placement", "in_process"]
    result = CliRunner().invoke(app, [*argv, "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 2
    assert "--engine monarch contradicts --placement in_process" in result.output


def test_monarch_engine_refuses_the_trl_backend(tmp_path):
    result = CliRunner().invoke(
        app, ["train", "--engine", "monarch", "--backend", "trl", "--output-dir", str(tmp_path)]
    )
    assert result.exit_code == 2
    assert "drop --backend trl" in result.output


@pytest.mark.slow
@pytest.mark.integration
def test_embedded_model_one_step_on_the_monarch_engine(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(f"""
steps = 1
output_dir = "{tmp_path / "run"}"
[eval]
every = 1
max_tasks = 1
samples_per_task = 1
[roles]
placement = "monarch"
generators = 1
rewarders = 1
[[envs]]
name = "python_functions"
tasks_per_step = 1
[envs.algorithm.sampling]
group_size = 2
max_new_tokens = 8
[envs.algorithm.advantage]
type = "grpo"
""")
    assert RunConfig.from_toml(path).model.source == "embedded"
    assert RunConfig.from_toml(path).roles.generators == 1
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "composer_replication.cli",
            "train",
            "--placement",
            "monarch",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "roles on monarch" in done.stdout
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    row = rows[-1]
    assert row["step"] == 1
    assert math.isfinite(row["loss"]) and row["tokens/sampled"] > 0
    # a group with equal rewards has no rl credit: the zero-advantage filter takes it
    assert (row["tokens/rl"] > 0) != (row["rollouts/zero_advantage"] > 0)
    assert 0.0 <= row["heldout/pass@1"] <= 1.0
    assert (tmp_path / "run" / "final_model" / "config.json").exists()
    assert (tmp_path / "run" / "checkpoints").exists()
