"""One owner per setting, one name per knob: algorithm-required loss settings fill the run's
``[loss]`` table, explicit contradictions fail naming both values, old spellings warn and
still work."""

from __future__ import annotations

import warnings

import pytest

from composer_replication.config import ConfigDeprecationWarning, LossConfig, RunConfig
from composer_replication.config.algorithm import AlgorithmConfig


def _composer(**advantage):
    return RunConfig.model_validate(
        {
            "envs": [
                {
                    "name": "python_functions",
                    "algorithm": {"advantage": {"type": "composer", **advantage}},
                }
            ]
        }
    )


def test_a_loss_setting_set_on_the_command_line_reaches_the_loss():
    cfg = RunConfig.default(["loss.sdpo_jsd_beta=0.9", "loss.replay_dpo_beta=0.3"])
    assert cfg.envs[0].algorithm.type == "composer"
    assert (cfg.loss.sdpo_jsd_beta, cfg.loss.replay_dpo_beta) == (0.9, 0.3)


def test_an_algorithm_requirement_fills_the_unset_loss_setting():
    cfg = _composer(sdpo_jsd_beta=0.8)
    assert cfg.loss.sdpo_jsd_beta == 0.8
    dpo = RunConfig.model_validate(
        {
            "envs": [
                {
                    "name": "python_functions",
                    "algorithm": {"advantage": {"type": "replay_dpo", "dpo_variant": "simpo"}},
                }
            ]
        }
    )
    assert dpo.loss.dpo_variant == "simpo"
    # validation is idempotent: the resolved config validates to itself
    assert RunConfig.model_validate(cfg.model_dump()) == cfg


def test_an_explicit_contradiction_names_both_values():
    with pytest.raises(ValueError) as err:
        RunConfig.model_validate(
            {
                "loss": {"sdpo_jsd_beta": 0.9},
                "envs": [
                    {
                        "name": "python_functions",
                        "algorithm": {"advantage": {"type": "composer", "sdpo_jsd_beta": 0.5}},
                    }
                ],
            }
        )
    message = str(err.value)
    assert "loss.sdpo_jsd_beta = 0.9" in message
    assert "envs.0.algorithm.advantage.sdpo_jsd_beta = 0.5" in message


def test_environments_that_need_different_settings_are_rejected():
    def env(name, beta, teacher="policy"):
        return {
            "name": name,
            "algorithm": {"advantage": {"type": "sdpo", "sdpo_jsd_beta": beta, "teacher": teacher}},
        }

    with pytest.raises(ValueError, match=r"need different loss\.sdpo_jsd_beta"):
        RunConfig.model_validate({"envs": [env("a:x", 0.5), env("b:y", 0.7)]})
    with pytest.raises(ValueError, match="different jsd teachers"):
        RunConfig.model_validate({"envs": [env("a:x", 0.5), env("b:y", 0.5, "ema")]})


def test_loss_temperature_follows_sampling_and_a_contradiction_fails():
    cfg = RunConfig.default(["envs.0.algorithm.sampling.temperature=0.7"])
    assert cfg.loss.temperature == 0.7
    with pytest.raises(ValueError, match=r"loss.temperature = 0.5 contradicts"):
        RunConfig.default(["loss.temperature=0.5"])


def test_old_spellings_warn_and_still_work():
    with pytest.warns(ConfigDeprecationWarning, match="'alpha' is deprecated, write 'alpha_sdpo'"):
        adv = AlgorithmConfig(advantage={"type": "composer", "alpha": 0.3}).advantage
    assert adv.alpha_sdpo == 0.3
    with pytest.warns(ConfigDeprecationWarning, match="'loss' is deprecated"):
        dpo = AlgorithmConfig(advantage={"type": "replay_dpo", "loss": "simpo"})
    assert dpo.advantage.dpo_variant == "simpo"
    with pytest.warns(ConfigDeprecationWarning, match="'jsd_beta' is deprecated"):
        loss = LossConfig(jsd_beta=0.3, dpo_beta=0.2, dpo_loss="simpo", jsd_temperature=0.5)
    assert (loss.sdpo_jsd_beta, loss.replay_dpo_beta, loss.dpo_variant, loss.sdpo_temperature) == (
        0.3,
        0.2,
        "simpo",
        0.5,
    )
    with pytest.raises(ValueError, match=r"alpha = 0.3 \(old spelling\) contradicts alpha_sdpo"):
        AlgorithmConfig(advantage={"type": "sdpo", "alpha": 0.3, "alpha_sdpo": 0.4})
    # the new spellings alone raise no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RunConfig.default(["loss.sdpo_jsd_beta=0.4"])


@pytest.mark.parametrize("kind", ["composer", "replay_dpo"])
def test_beta_is_retired_with_what_to_write_instead(kind):
    """beta meant replay_dpo_beta under replay_dpo and beta_replay under composer: one
    name, two meanings, so it is refused in one line naming both."""
    with pytest.raises(ValueError, match=r"beta = 0\.2 is retired: .*replay_dpo_beta.*beta_replay"):
        AlgorithmConfig(advantage={"type": kind, "beta": 0.2})


def test_run_level_spellings_fold_into_the_owning_algorithms(tmp_path):
    with pytest.warns(ConfigDeprecationWarning, match="jsd_teacher is deprecated"):
        cfg = RunConfig.default(["jsd_teacher=ema", "ema_decay=0.5"])
    assert cfg.envs[0].algorithm.advantage.teacher_mode == ("ema", 0.5)
    assert cfg.teacher_mode == ("ema", 0.5) and cfg.jsd_teacher is None
    with pytest.warns(ConfigDeprecationWarning, match="pairs_file is deprecated"):
        cfg = RunConfig.default([f"pairs_file={tmp_path / 'p.jsonl'}"])
    assert cfg.envs[0].algorithm.advantage.pairs_path == str(tmp_path / "p.jsonl")
    with (
        pytest.raises(ValueError, match="jsd_teacher = 'ema' contradicts"),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore", ConfigDeprecationWarning)
        RunConfig.model_validate(
            {
                "jsd_teacher": "ema",
                "envs": [
                    {
                        "name": "python_functions",
                        "algorithm": {"advantage": {"type": "composer", "teacher": "initial"}},
                    }
                ],
            }
        )


def test_the_config_package_imports_no_runtime_code():
    import subprocess
    import sys

    code = (
        "import sys; import composer_replication.config as c; c.RunConfig.default(); "
        "bad = sorted(m for m in sys.modules if m == 'torch' or (m.startswith('composer_rep"
        "lication.') and not m.startswith(('composer_replication.config', "
        "'composer_replication._moved')))); print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_trl_presets_build_on_this_machine_without_device_flags(tmp_path):
    import torch

    from composer_replication.backends.trl.po_presets import make_dr_grpo_config, make_po_config

    args = make_dr_grpo_config(output_dir=str(tmp_path), report_to="none")
    has_gpu = torch.cuda.is_available()
    assert args.use_cpu is (not has_gpu)
    if not has_gpu:
        assert args.bf16 is False
    assert make_po_config("dapo", output_dir=str(tmp_path), report_to="none").loss_type == "dapo"
    # an explicit choice is kept
    assert make_dr_grpo_config(output_dir=str(tmp_path), use_cpu=True, bf16=False).use_cpu


def test_a_channel_weight_has_one_owner():
    """alpha_sdpo owns the SDPO term's weight and beta_replay the replayed pairs': a loss
    coefficient on their component would scale them twice, so it is refused there."""
    for component, field in (("jsd", "alpha_sdpo"), ("dpo", "beta_replay")):
        with pytest.raises(
            ValueError, match=rf"loss.coefficients.{component} = 0.5 .*advantage.{field}"
        ):
            RunConfig.default([f"loss.coefficients.{component}=0.5"])  # the composer default
    # an algorithm without that weight leaves the coefficient the only scale
    grpo = RunConfig.default(
        ['envs.0.algorithm.advantage={"type": "grpo"}', "loss.coefficients.jsd=0.5"]
    )
    assert grpo.loss.coefficients["jsd"] == 0.5
