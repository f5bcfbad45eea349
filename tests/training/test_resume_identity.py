"""Resume checks what it resumes: a checkpoint records its run's identity (model,
environments with their algorithms and tasks, loss, split); ``--resume`` with a config that
changes any of it is refused in one line naming the difference, before anything loads and
with the run's record left as it was; what may change (steps, evaluation, optimizer, ...)
resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from composer_replication.common.errors import UsageError
from composer_replication.config import RunConfig
from composer_replication.config.identity import identity_difference, run_identity
from composer_replication.preflight import check_resume

HERE = Path(__file__).resolve().parent


CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "runs"


def _identity(overrides: list[str], config: str | None = None) -> dict:
    cfg = (
        RunConfig.from_toml(CONFIGS / config, overrides) if config else RunConfig.default(overrides)
    )
    return run_identity(cfg.model_dump(mode="json"))


def test_the_identity_is_what_defines_the_objective() -> None:
    base = _identity([])
    assert identity_difference(base, _identity([])) is None
    for allowed in (
        "steps=99",
        "optim.lr=1e-5",
        "eval.every=3",
        "seed=7",
        "micro_batch_tokens=1024",
        "max_wall_seconds=60",
    ):
        assert identity_difference(base, _identity([allowed])) is None, allowed
    changed = identity_difference(base, _identity([], "grpo.toml"))
    assert changed == (
        "envs.0.algorithm.type: 'composer' in the checkpoint's run, 'grpo' in this config"
    )
    assert identity_difference(base, _identity(["heldout_fraction=0.5"])) == (
        "heldout_fraction: 0.25 in the checkpoint's run, 0.5 in this config"
    )
    lora = identity_difference(base, _identity(["model.lora.r=8"]))
    assert lora == "model.lora.r: 16 in the checkpoint's run, 8 in this config"
    two = dict(base, envs=[*base["envs"], base["envs"][0]])
    assert identity_difference(base, two) == (
        "number of envs: 1 in the checkpoint's run, 2 in this config"
    )
    other_env = dict(base, envs=[dict(base["envs"][0], name="feature_deletion")])
    assert identity_difference(base, other_env) == (
        "envs.0.name: 'python_functions' in the checkpoint's run, 'feature_deletion' in this config"
    )


def _prepared_run(run_dir: Path, config: RunConfig, *, identity_file: bool) -> None:
    step = run_dir / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    (step / "state.pt").write_bytes(b"x")
    (step / "trainable.safetensors").write_bytes(b"x")
    recorded = config.model_dump(mode="json")
    (run_dir / "config.json").write_text(json.dumps(recorded))
    if identity_file:
        (step / "identity.json").write_text(json.dumps(run_identity(recorded)))


@pytest.mark.parametrize("identity_file", [True, False], ids=["identity.json", "config.json"])
def test_resume_with_another_algorithm_is_refused_before_anything_loads(
    tmp_path: Path, identity_file: bool
) -> None:
    run_dir = tmp_path / "run"
    _prepared_run(
        run_dir, RunConfig.default([f"output_dir={run_dir}"]), identity_file=identity_file
    )
    before = (run_dir / "config.json").read_bytes()
    other = RunConfig.from_toml(CONFIGS / "grpo.toml", [f"output_dir={run_dir}"])
    with pytest.raises(UsageError) as refused:
        check_resume(other)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        f"--resume: the checkpoint in {str(run_dir)!r} belongs to another run"
    )
    assert "envs.0.algorithm.type: 'composer' in the checkpoint's run, 'grpo' in this config" in (
        message
    )
    assert (run_dir / "config.json").read_bytes() == before
    same = RunConfig.default([f"output_dir={run_dir}", "steps=20", "optim.lr=1e-5"])
    assert check_resume(same) is True  # what may change, changes


@pytest.mark.integration
def test_train_resume_refuses_another_run_and_continues_its_own(tmp_path: Path, tiny_dir) -> None:
    """Real processes through the command line: one step, then --resume with the same
    config (continues) and with another algorithm, two environments, or another environment
    (each refused in one line; config.json and the checkpoints as they were)."""
    from composer_replication.cli import app

    run_dir = tmp_path / "run"
    common = [
        "--output-dir", str(run_dir), "--set", f"model.source={tiny_dir}",
        "--set", "model.lora.r=4", "--set", "model.lora.alpha=8",
        "--set", "envs.0.tasks_per_step=1", "--set", "envs.0.algorithm.sampling.group_size=2",
        "--set", "envs.0.algorithm.sampling.max_new_tokens=8",
        "--set", "eval.every=100", "--set", "eval.at_start=false", "--set", "eval.max_tasks=2",
        "--set", "eval.samples_per_task=1", "--set", "checkpoint.every=1",
    ]  # fmt: skip
    grpo, sdpo = str(CONFIGS / "grpo.toml"), str(CONFIGS / "sdpo.toml")
    two_envs = tmp_path / "two.toml"
    env = (CONFIGS / "grpo.toml").read_text().split("envs = [", 1)[1].rsplit("]", 1)[0]
    two_envs.write_text(f"steps = 6\nenvs = [{env}, {env}]\n")
    first = CliRunner().invoke(app, ["train", grpo, *common, "--set", "steps=1"])
    assert first.exit_code == 0, first.output[-3000:]
    record = {p: p.read_bytes() for p in [run_dir / "config.json", *run_dir.rglob("step_*/*")]}
    for config, needle in (
        (sdpo, "envs.0.algorithm.type: 'grpo' in the checkpoint's run, 'sdpo' in this config"),
        (str(two_envs), "number of envs: 1 in the checkpoint's run, 2 in this config"),
    ):
        refused = CliRunner().invoke(
            app, ["train", config, *common, "--set", "steps=2", "--resume"]
        )
        assert refused.exit_code == 2, refused.output[-3000:]
        errors = [line for line in refused.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and needle in " ".join(refused.stderr.split()), refused.stderr
        assert "Traceback" not in refused.output
        assert {p: p.read_bytes() for p in record} == record
    resumed = CliRunner().invoke(app, ["train", grpo, *common, "--set", "steps=2", "--resume"])
    assert resumed.exit_code == 0, resumed.output[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][-1] == 2
    assert json.loads((run_dir / "checkpoints" / "step_000002" / "identity.json").read_text()) == (
        run_identity(json.loads((run_dir / "config.json").read_text()))
    )
