"""po_presets against the installed trl: every objective's knobs land in GRPOConfig, the
menu is enforced, and drift (a knob trl rewrites, drops or does not support) fails loudly."""

from __future__ import annotations

import dataclasses

import pytest
import trl

from composer_replication.backends.trl.po_presets import (
    PO_OBJECTIVES,
    PO_PAPERS,
    make_dr_grpo_config,
    make_po_config,
)

COMMON = {"use_cpu": True, "bf16": False, "report_to": "none"}

EXPECTED = {
    "grpo": {"loss_type": "grpo", "scale_rewards": "group", "importance_sampling_level": "token"},
    "dr_grpo": {"loss_type": "dr_grpo", "scale_rewards": "none"},
    "bnpo": {"loss_type": "bnpo", "scale_rewards": "batch"},
    "dapo": {
        "loss_type": "dapo",
        "scale_rewards": "none",
        "epsilon_high": 0.28,
        "mask_truncated_completions": True,
        "beta": 0.0,
    },
    "gspo": {
        "loss_type": "grpo",
        "scale_rewards": "group",
        "importance_sampling_level": "sequence",
    },
    "cispo": {"loss_type": "cispo", "scale_rewards": "none", "epsilon_high": 5.0},
    "sapo": {"loss_type": "sapo", "scale_rewards": "group", "importance_sampling_level": "token"},
    "luspo": {
        "loss_type": "luspo",
        "scale_rewards": "group",
        "importance_sampling_level": "sequence",
    },
    "vespo": {"loss_type": "vespo", "scale_rewards": "group", "importance_sampling_level": "token"},
}


def test_menu_and_papers_cover_the_same_objectives():
    assert set(PO_OBJECTIVES) == set(EXPECTED) == set(PO_PAPERS)
    assert all(paper.startswith("arXiv:") for paper in PO_PAPERS.values())


@pytest.mark.parametrize("objective", sorted(EXPECTED))
def test_each_preset_builds_a_grpo_config_with_its_knobs(objective, tmp_path):
    config = make_po_config(objective, output_dir=str(tmp_path), **COMMON)
    assert isinstance(config, trl.GRPOConfig)
    for knob, value in EXPECTED[objective].items():
        assert getattr(config, knob) == value, knob
    assert config.output_dir == str(tmp_path)


def test_default_objective_is_dr_grpo(tmp_path):
    config = make_po_config(output_dir=str(tmp_path), **COMMON)
    assert (config.loss_type, config.scale_rewards) == ("dr_grpo", "none")


def test_overrides_win_over_the_preset_and_pass_through(tmp_path):
    config = make_po_config(
        "dapo", epsilon_high=0.3, learning_rate=3e-4, output_dir=str(tmp_path), **COMMON
    )
    assert config.epsilon_high == 0.3 and config.learning_rate == 3e-4
    assert config.loss_type == "dapo" and config.mask_truncated_completions is True


def test_unknown_objective_lists_the_menu():
    with pytest.raises(ValueError, match="unknown objective 'ppo'") as err:
        make_po_config("ppo")
    for name in EXPECTED:
        assert name in str(err.value)


def test_make_dr_grpo_config_forces_its_three_knobs(tmp_path):
    config = make_dr_grpo_config(output_dir=str(tmp_path), **COMMON)
    assert (config.loss_type, config.scale_rewards, config.num_iterations) == (
        "dr_grpo",
        "none",
        1,
    )
    config = make_dr_grpo_config(num_iterations=2, output_dir=str(tmp_path), **COMMON)
    assert config.num_iterations == 2 and config.loss_type == "dr_grpo"


def test_scale_rewards_aliases_are_normalised(tmp_path):
    config = make_dr_grpo_config(scale_rewards=True, output_dir=str(tmp_path), **COMMON)
    assert config.scale_rewards == "group"


def test_a_knob_that_trl_rewrites_raises_assertion(monkeypatch, tmp_path):
    @dataclasses.dataclass
    class DriftedConfig(trl.GRPOConfig):
        def __post_init__(self):
            super().__post_init__()
            self.loss_type = "dapo"  # a future trl silently replacing the objective

    monkeypatch.setattr(trl, "GRPOConfig", DriftedConfig)
    with pytest.raises(
        AssertionError, match="did not apply loss_type: asked 'dr_grpo', got 'dapo'"
    ):
        make_dr_grpo_config(output_dir=str(tmp_path), **COMMON)


def test_a_knob_missing_from_trl_raises_assertion(monkeypatch):
    monkeypatch.setitem(PO_OBJECTIVES, "future", {"loss_type": "grpo", "no_such_knob": 1})
    with pytest.raises(AssertionError, match=r"no field\(s\) \['no_such_knob'\]"):
        make_po_config("future")


def test_a_loss_type_trl_does_not_document_raises_assertion(monkeypatch):
    monkeypatch.setitem(PO_OBJECTIVES, "future", {"loss_type": "ppo_plus"})
    with pytest.raises(AssertionError, match="loss_type='ppo_plus' is not among"):
        make_po_config("future")
