"""The PRIME-RL export: the TOML it writes, the algorithm mapping, the errors for what has
no equivalent, and the command line."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import tomllib
import torch
from typer.testing import CliRunner

from composer_replication.cli import app
from composer_replication.config import RunConfig
from composer_replication.recipes.prime_rl.composer_loss import prime_rl_loss
from composer_replication.recipes.prime_rl.export import (
    EMBEDDED_HUB_ID,
    PRIME_RL_TYPES,
    UnsupportedAlgorithmError,
    export_run_config,
)

MIXED = """
steps = 12
[model]
source = "embedded"
[model.lora]
r = 8
alpha = 16
[optim]
lr = 2e-5
[loss]
mask_high = 0.1
mask_low = 0.2
adv_tau = 2.0
kl_tau = 0.001
coefficients = {rl = 0.5}

[[envs]]
name = "python_functions"
tasks_per_step = 3
[envs.algorithm.sampling]
group_size = 4
max_new_tokens = 128
[envs.algorithm.advantage]
type = "grpo"

[[envs]]
name = "tasks.envs:make_b"
tasks_per_step = 2
[envs.algorithm.sampling]
group_size = 8
max_new_tokens = 64
[envs.algorithm.advantage]
type = "max_rl"

[[envs]]
name = "feature_deletion"
tasks_per_step = 1
[envs.algorithm.sampling]
group_size = 2
[envs.algorithm.advantage]
type = "opd"
model = {name = "Qwen/Qwen3-8B", base_url = "http://teacher:8001/v1", api_key_env = "TEACHER_KEY"}

[[envs]]
name = "tasks.envs:make_d"
[envs.algorithm.advantage]
type = "opsd"

[[envs]]
name = "tasks.envs:make_e"
[envs.algorithm.sampling]
source = {name = "big-coder", base_url = "http://sampler:9000/v1"}
[envs.algorithm.advantage]
type = "sft"

[[envs]]
name = "tasks.envs:make_f"
[envs.algorithm.advantage]
type = "echo"
roles = {tool = {alpha = 0.2}, user = {alpha = 0.05}, system = {alpha = 0.0}}
"""


def _config(text: str) -> RunConfig:
    return RunConfig.from_toml(text)


def _resolve_like_prime_rl(dotted_path: str):
    module_path, _, name = dotted_path.rpartition(".")
    return getattr(importlib.import_module(module_path), name)


def test_mixed_run_exports_every_field_and_only_prime_rl_types():
    doc = tomllib.loads(export_run_config(_config(MIXED), seq_len=1024).toml)
    assert doc["max_steps"] == 12 and doc["seq_len"] == 1024
    assert doc["model"] == {"name": EMBEDDED_HUB_ID}
    orch = doc["orchestrator"]
    # Rollouts per step: 3*4 + 2*8 + 1*2 + 4*4 + 4*4 + 4*4.
    assert orch["batch_size"] == 12 + 16 + 2 + 16 + 16 + 16
    assert orch["group_size"] == 4 and orch["algo"] == {"type": "grpo"}
    sources = orch["train"]["source"]
    names = [
        "python_functions",
        "tasks.envs:make_b",
        "feature_deletion",
        "tasks.envs:make_d",
        "tasks.envs:make_e",
        "tasks.envs:make_f",
    ]
    assert [s["name"] for s in sources] == names
    assert [s["env"]["taskset"]["id"] for s in sources] == names
    assert [s["algo"]["type"] for s in sources] == ["grpo", "max_rl", "opd", "opsd", "sft", "echo"]
    assert {s["algo"]["type"] for s in sources} <= set(PRIME_RL_TYPES)
    assert sources[0]["sampling"] == {"temperature": 1.0, "max_completion_tokens": 128}
    assert sources[1]["group_size"] == 8 and sources[1]["ratio"] == 16.0
    assert sources[2]["algo"]["teacher"] == {
        "name": "Qwen/Qwen3-8B",
        "base_url": "http://teacher:8001/v1",
        "api_key_var": "TEACHER_KEY",
    }
    assert sources[3]["algo"] == {"type": "opsd", "demo_key": "reference"}
    assert sources[4]["algo"]["sampling"]["source"] == {
        "name": "big-coder",
        "base_url": "http://sampler:9000/v1",
    }
    # Roles with alpha 0 train nothing and PRIME-RL requires alpha > 0: left out.
    assert sources[5]["algo"]["roles"] == {"tool": {"alpha": 0.2}, "user": {"alpha": 0.05}}
    trainer = doc["trainer"]
    assert trainer["optim"] == {
        "lr": 2e-5,
        "weight_decay": 0.0,
        "betas1": 0.9,
        "betas2": 0.99,
        "max_norm": 1.0,
    }
    assert trainer["model"]["lora"]["rank"] == 8 and trainer["model"]["lora"]["alpha"] == 16.0
    loss = trainer["loss"]
    assert loss["type"] == "custom"
    # The rl coefficient 0.5 scales both terms of the rl mean.
    assert loss["kwargs"] == {
        "dppo_mask_high": 0.1,
        "dppo_mask_low": 0.2,
        "adv_tau": 1.0,
        "kl_tau": 0.0005,
    }


def test_mixed_run_with_ref_kl_settings_prime_rl_fixes_is_refused():
    # opd/opsd train PRIME-RL's built-in ref_kl (mask_low 0.2): mask_low = 0.3 cannot export.
    text = MIXED.replace("mask_low = 0.2", "mask_low = 0.3")
    with pytest.raises(UnsupportedAlgorithmError, match=r"mask_low = 0.3"):
        export_run_config(_config(text), seq_len=1024)
    text = MIXED.replace("coefficients = {rl = 0.5}", "coefficients = {rl = 0.5, ref_kl = 2.0}")
    with pytest.raises(UnsupportedAlgorithmError, match=r"coefficients.ref_kl = 2.0"):
        export_run_config(_config(text), seq_len=1024)
    text = MIXED.replace("coefficients = {rl = 0.5}", "coefficients = {rl = 0.5, ce = 0.5}")
    with pytest.raises(UnsupportedAlgorithmError, match=r"coefficients.ce = 0.5"):
        export_run_config(_config(text), seq_len=1024)
    custom = 'type = "custom"\nimport_path = "composer_replication.ops.token_losses:rl_loss"'
    text = MIXED.replace("coefficients = {rl = 0.5}", custom)
    with pytest.raises(UnsupportedAlgorithmError, match=r"type = 'custom'"):
        export_run_config(_config(text), seq_len=1024)
    text = MIXED.replace("coefficients = {rl = 0.5}", "lm_ce_label_smoothing = 0.1")
    with pytest.raises(UnsupportedAlgorithmError, match=r"lm_ce_label_smoothing = 0.1"):
        export_run_config(_config(text), seq_len=1024)


def test_exported_import_path_resolves_and_its_kwargs_run():
    doc = tomllib.loads(export_run_config(_config(MIXED)).toml)
    loss = doc["trainer"]["loss"]
    fn = _resolve_like_prime_rl(loss["import_path"])
    assert fn is prime_rl_loss
    g = torch.Generator().manual_seed(0)
    lp = torch.rand(16, generator=g).clamp_min(0.05).log().requires_grad_()
    inputs = SimpleNamespace(
        trainer_logprobs=lp,
        inference_logprobs=lp.detach() + 0.1 * torch.randn(16, generator=g),
        ref_logprobs=None,
        advantages=torch.randn(16, generator=g),
        loss_mask=torch.ones(16, dtype=torch.bool),
        loss_weights=None,
    )
    out = fn(inputs, **loss["kwargs"])
    assert out.loss.dim() == 0 and torch.isfinite(out.loss)
    out.loss.backward()
    assert lp.grad is not None and torch.isfinite(lp.grad).all()


def _env(
    advantage: str, name: str = "python_functions", sampling: str = "", group_size: int = 4
) -> str:
    return f"""
[[envs]]
name = "{name}"
[envs.algorithm.sampling]
group_size = {group_size}
{sampling}
[envs.algorithm.advantage]
{advantage}
"""


def test_every_unsupported_environment_is_listed_with_its_reason():
    text = (
        _env('type = "sdpo"')
        + _env('type = "replay_dpo"', name="tasks.envs:make_2")
        + _env('type = "reward"', name="tasks.envs:make_3")
        + _env('type = "custom"\nimport_path = "my_pkg.adv:fn"', name="tasks.envs:make_4")
        + _env('type = "composer"', name="tasks.envs:make_5")
        + _env('type = "grpo"', name="tasks.envs:make_6")
    )
    with pytest.raises(UnsupportedAlgorithmError) as info:
        export_run_config(_config(text))
    message = str(info.value)
    for name, kind, reason in [
        ("python_functions", "sdpo", "full-vocabulary JSD"),
        ("tasks.envs:make_2", "replay_dpo", "no pairs"),
        ("tasks.envs:make_3", "reward", "no baseline-free"),
        ("tasks.envs:make_4", "custom", "import path"),
        ("tasks.envs:make_5", "composer", "--drop-unsupported"),
    ]:
        assert f"environment {name!r}: algorithm {kind!r} has no PRIME-RL equivalent" in message
        assert reason in message
    assert "make_6" not in message


def test_drop_unsupported_exports_composer_as_grpo_and_says_what_was_dropped():
    text = _env('type = "composer"\nalpha_sdpo = 0.3\nbeta_replay = 0.07')
    result = export_run_config(_config(text), drop_unsupported=True)
    doc = tomllib.loads(result.toml)
    assert doc["orchestrator"]["train"]["source"][0]["algo"] == {"type": "grpo"}
    # the dropped channels, then the default linear LR schedule PRIME-RL is not given
    assert len(result.warnings) == 2 and "optim.schedule = 'linear'" in result.warnings[1]
    assert "alpha_sdpo = 0.3" in result.warnings[0] and "beta_replay = 0.07" in result.warnings[0]
    assert f"# NOTE: {result.warnings[0]}" in result.toml
    # The flag never turns the other algorithms into something they are not.
    with pytest.raises(UnsupportedAlgorithmError, match="'sdpo'"):
        export_run_config(_config(_env('type = "sdpo"')), drop_unsupported=True)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        (
            _env('type = "opd"\nmodel = {name = "t", local_path = "/models/t"}'),
            "local model '/models/t', which has no endpoint",
        ),
        (
            _env('type = "sft"', sampling='source = {name = "s", local_path = "/models/s"}'),
            "sft sampling source is the local model",
        ),
        (
            _env('type = "sft"', sampling='source = "reference"', group_size=1),
            "sft sampling source is 'reference'",
        ),
        (_env('type = "grpo"\nstd_normalize = true'), "std_normalize"),
        (_env('type = "grpo"\nlength_penalty = 0.1\nlength_target = 50'), "length_penalty"),
        (
            _env(
                'type = "sft"\nce_weight = 2.0',
                sampling='source = {name = "s", base_url = "http://s/v1"}',
            ),
            "ce_weight",
        ),
        (
            _env('type = "echo"\nroles = {observation = {alpha = 0.1}}', name="feature_deletion"),
            "echo roles \\['observation'\\]",
        ),
        (
            _env('type = "echo"\nfilter = "my_pkg.f:keep"', name="feature_deletion"),
            "echo filter",
        ),
        (
            _env('type = "opsd"\nmodel = {name = "t", base_url = "http://t/v1"}'),
            "PRIME-RL's opsd\nteacher is always the live policy".replace("\n", " "),
        ),
        (_env('type = "grpo"', sampling="max_new_tokens = 4096"), "raise --seq-len"),
        (_env('type = "grpo"', sampling="temperature = 2.5"), "temperature = 2.5"),
    ],
)
def test_settings_prime_rl_cannot_express_are_refused(env, match):
    with pytest.raises(UnsupportedAlgorithmError, match=match):
        export_run_config(_config(env))


def test_gguf_policy_and_bad_seq_len_are_refused():
    with pytest.raises(ValueError, match="GGUF"):
        export_run_config(_config('[model]\nsource = "/m/policy.gguf"\n' + _env('type = "grpo"')))
    with pytest.raises(ValueError, match="seq_len = 0"):
        export_run_config(_config(_env('type = "grpo"')), seq_len=0)


def test_full_fine_tune_writes_no_lora_and_options_are_noted():
    text = "[model]\nlora = {}\n" + _env('type = "grpo"')
    config = _config(text).model_copy()
    config.model.lora = None
    config.envs[0].options = {"difficulty": "hard"}
    result = export_run_config(config)
    doc = tomllib.loads(result.toml)
    assert "model" not in doc["trainer"]
    assert any("options ['difficulty'] are not exported" in w for w in result.warnings)


def test_optimizer_settings_without_a_prime_rl_field_are_noted():
    text = '[optim]\ngrad_clip = 0.5\nschedule = "cosine"\nwarmup_steps = 3\n' + _env(
        'type = "grpo"'
    )
    result = export_run_config(_config(text))
    assert tomllib.loads(result.toml)["trainer"]["optim"]["max_norm"] == 0.5
    assert any("schedule = 'cosine', warmup_steps = 3" in w for w in result.warnings)
    config = _config(_env('type = "grpo"'))
    config.optim.grad_clip = None
    result = export_run_config(config)
    assert "max_norm" not in tomllib.loads(result.toml)["trainer"]["optim"]
    assert any("grad_clip = null" in w for w in result.warnings)


runner = CliRunner()


def test_cli_writes_the_file_atomically_and_fails_clearly(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(_env('type = "max_rl"'))
    out = tmp_path / "sub" / "prime.toml"
    result = runner.invoke(app, ["export", "prime-rl", str(config), "-o", str(out)])
    assert result.exit_code == 0, result.output
    doc = tomllib.loads(out.read_text())
    assert doc["orchestrator"]["algo"] == {"type": "max_rl"}
    assert [p.name for p in out.parent.iterdir()] == ["prime.toml"]  # no temporary left
    # stdout when no -o.
    result = runner.invoke(app, ["export", "prime-rl", str(config), "--seq-len", "4096"])
    assert result.exit_code == 0
    assert tomllib.loads(result.stdout)["seq_len"] == 4096

    config.write_text(_env('type = "composer"'))
    result = runner.invoke(app, ["export", "prime-rl", str(config), "-o", str(out)])
    assert result.exit_code == 2
    assert "algorithm 'composer' has no PRIME-RL equivalent" in result.stderr
    assert tomllib.loads(out.read_text())["orchestrator"]["algo"] == {"type": "max_rl"}  # untouched

    result = runner.invoke(
        app, ["export", "prime-rl", str(config), "-o", str(out), "--drop-unsupported"]
    )
    assert result.exit_code == 0
    assert "warning: environment 'python_functions': composer exported as grpo" in result.stderr
    assert tomllib.loads(out.read_text())["orchestrator"]["algo"] == {"type": "grpo"}

    result = runner.invoke(app, ["export", "prime-rl", str(tmp_path / "missing.toml")])
    assert result.exit_code == 2 and "does not exist" in result.stderr
