"""AlgorithmConfig: shape, every config-time validation, shorthand folding, TOML round trip."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from pydantic import ValidationError

from composer_replication.algo import (
    AlgorithmConfig,
    ComposerAdvantage,
    EchoAdvantage,
    FrozenEndpoint,
    GRPOAdvantage,
    LocalFrozenModel,
    OPSDAdvantage,
)
from composer_replication.config.algorithm import tomllib
from composer_replication.config.toml_writer import dumps

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "algorithms"
ENDPOINT = {"name": "teacher-1.7b", "base_url": "http://127.0.0.1:8000/v1"}
LOCAL = {"name": "tiny", "local_path": "/models/tiny"}
RL_TYPES = ["grpo", "max_rl", "reward", "sdpo", "echo", "composer"]


def test_defaults_are_grpo_on_policy():
    config = AlgorithmConfig()
    assert config.type == "grpo"
    assert config.sampling.source == "policy"
    assert (config.sampling.group_size, config.sampling.temperature) == (4, 1.0)
    assert config.sampling.max_new_tokens == 256
    assert config.advantage == GRPOAdvantage(std_normalize=False, eps=1e-6, length_penalty=0.0)
    assert config.model is None


def test_class_defaults_are_the_vetted_settings():
    composer = AlgorithmConfig(advantage={"type": "composer"}).advantage
    assert isinstance(composer, ComposerAdvantage)
    assert (composer.alpha_sdpo, composer.beta_replay) == (0.1, 0.05)
    # No loss requirement by default: the run's [loss] table decides (0.5 and 0.1).
    assert composer.loss_requirements() == {}
    assert composer.teacher_mode == ("policy", 0.99)
    sdpo = AlgorithmConfig(advantage={"type": "sdpo"}).advantage
    assert (sdpo.alpha_sdpo, sdpo.teacher, sdpo.use_sibling_demos) == (1.0, "policy", True)
    echo = AlgorithmConfig(advantage={"type": "echo"}).advantage
    # tool outputs, under a tool role or (templates without one) a user role
    assert {k: v.alpha for k, v in echo.roles.items()} == {"tool": 0.1, "user": 0.1}
    dpo = AlgorithmConfig(advantage={"type": "replay_dpo"}).advantage
    assert (dpo.beta_replay, dpo.dpo_variant, dpo.pairs_path) == (1.0, None, None)
    assert AlgorithmConfig(advantage={"type": "max_rl"}).advantage.eps == 1e-6
    opsd = AlgorithmConfig(advantage={"type": "opsd"}).advantage
    assert opsd.model == "policy"


def test_unknown_type_and_extra_fields_are_rejected():
    with pytest.raises(ValidationError, match=r"type 'ppo' is neither a built-in algorithm"):
        AlgorithmConfig(advantage={"type": "ppo"})
    with pytest.raises(ValidationError, match=r"advantage\.type is missing"):
        AlgorithmConfig(advantage={"std_normalize": True})
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        AlgorithmConfig(advantage={"type": "grpo", "alpha": 0.1})
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        AlgorithmConfig(sampling={"group_size": 4, "n": 2})


def test_opd_against_policy_is_degenerate():
    with pytest.raises(ValidationError, match="degenerate"):
        AlgorithmConfig(advantage={"type": "opd", "model": "policy"})
    with pytest.raises(ValidationError, match="degenerate"):
        AlgorithmConfig(advantage={"type": "opd"}, model="policy")


def test_opd_needs_a_teacher():
    with pytest.raises(ValidationError, match="opd needs a frozen teacher"):
        AlgorithmConfig(advantage={"type": "opd"})


@pytest.mark.parametrize("kind", [*RL_TYPES, "custom"])
@pytest.mark.parametrize("source", [ENDPOINT, LOCAL])
def test_frozen_sampling_cannot_feed_rl(kind, source):
    advantage = {"type": kind}
    if kind == "custom":
        advantage["import_path"] = "pkg.mod:fn"
    with pytest.raises(ValidationError, match="needs the policy's own sampling log-probs"):
        AlgorithmConfig(sampling={"source": source}, advantage=advantage)


def test_sft_needs_a_frozen_source():
    with pytest.raises(ValidationError, match="sft trains on tokens sampled from a frozen source"):
        AlgorithmConfig(advantage={"type": "sft"})
    config = AlgorithmConfig(sampling={"source": LOCAL}, advantage={"type": "sft"})
    assert config.sampling.source == LocalFrozenModel(**LOCAL)


@pytest.mark.parametrize("kind", ["grpo", "max_rl", "sdpo", "composer", "echo"])
def test_group_relative_with_group_of_one_warns(kind):
    with pytest.warns(
        UserWarning, match=rf"'{kind}' is group-relative, but sampling.group_size = 1"
    ):
        AlgorithmConfig(sampling={"group_size": 1}, advantage={"type": kind})


@pytest.mark.parametrize("kind", ["reward", "replay_dpo"])
def test_non_group_relative_with_group_of_one_is_silent(kind):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AlgorithmConfig(sampling={"group_size": 1}, advantage={"type": kind})


def test_frozen_reference_without_endpoint_is_a_parse_error():
    with pytest.raises(ValidationError, match="frozen model 'x' has no endpoint"):
        AlgorithmConfig(advantage={"type": "opd", "model": {"name": "x"}})
    with pytest.raises(ValidationError, match="has no endpoint"):
        AlgorithmConfig(advantage={"type": "opd", "model": {"name": "x", "base_url": ""}})
    with pytest.raises(ValidationError, match="base_url is empty"):
        FrozenEndpoint(name="x", base_url="  ")
    with pytest.raises(ValidationError, match="must start with http"):
        FrozenEndpoint(name="x", base_url="localhost:8000")
    with pytest.raises(ValidationError, match="is not 'policy'"):
        AlgorithmConfig(advantage={"type": "opsd", "model": "initial"})


def test_model_shorthand_folds_into_the_declared_slot():
    opd = AlgorithmConfig(advantage={"type": "opd"}, teacher=ENDPOINT)
    assert opd.advantage.model == FrozenEndpoint(**ENDPOINT)
    assert opd.model is None
    opsd = AlgorithmConfig(advantage={"type": "opsd"}, model=LOCAL)
    assert opsd.advantage.model == LocalFrozenModel(**LOCAL)
    sft = AlgorithmConfig(advantage={"type": "sft"}, model=ENDPOINT)
    assert sft.sampling.source == FrozenEndpoint(**ENDPOINT)
    # the same model in both places is not a contradiction
    same = AlgorithmConfig(advantage={"type": "opd", "model": ENDPOINT}, teacher=ENDPOINT)
    assert same.advantage.model.base_url == "http://127.0.0.1:8000/v1"


def test_model_shorthand_contradictions_are_rejected():
    with pytest.raises(ValidationError, match=r"contradicts advantage\.model"):
        AlgorithmConfig(advantage={"type": "opd", "model": ENDPOINT}, teacher=LOCAL)
    with pytest.raises(ValidationError, match=r"contradicts advantage\.model"):
        AlgorithmConfig(advantage={"type": "opsd", "model": "policy"}, model=LOCAL)
    with pytest.raises(ValidationError, match=r"contradicts sampling\.source"):
        AlgorithmConfig(sampling={"source": LOCAL}, advantage={"type": "sft"}, model=ENDPOINT)
    with pytest.raises(ValidationError, match="has no slot in advantage type 'grpo'"):
        AlgorithmConfig(model=ENDPOINT)


def test_field_validations():
    with pytest.raises(ValidationError, match="needs length_target"):
        AlgorithmConfig(advantage={"type": "grpo", "length_penalty": 0.1})
    with pytest.raises(ValidationError, match="String should match pattern"):
        AlgorithmConfig(advantage={"type": "custom", "import_path": "pkg.module.function"})
    with pytest.raises(ValidationError, match="lacks the placeholder"):
        OPSDAdvantage(demo_template="{content} only")
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        AlgorithmConfig(sampling={"group_size": 0})
    with pytest.raises(ValidationError, match="less than 1"):
        AlgorithmConfig(advantage={"type": "sdpo", "ema_decay": 1.0})


ROUND_TRIP = [
    AlgorithmConfig(),
    AlgorithmConfig(
        sampling={"group_size": 8, "temperature": 0.7},
        advantage={
            "type": "grpo",
            "std_normalize": True,
            "length_penalty": 0.2,
            "length_target": 64,
        },
    ),
    AlgorithmConfig(advantage={"type": "max_rl", "eps": 1e-3}),
    AlgorithmConfig(sampling={"group_size": 1}, advantage={"type": "reward"}),
    AlgorithmConfig(
        advantage={
            "type": "custom",
            "import_path": "pkg.adv:fn",
            "kwargs": {"scale": 2.5, "name": 'a "quoted"\nline é', "nested": {"k": [1, 2]}},
        }
    ),
    AlgorithmConfig(advantage={"type": "opd"}, teacher={**ENDPOINT, "api_key_env": "KEY"}),
    AlgorithmConfig(
        advantage={"type": "opsd", "model": LOCAL, "demo_template": "{content}|{demonstration}"}
    ),
    AlgorithmConfig(advantage={"type": "sdpo", "teacher": "ema", "hint_source": "feedback"}),
    AlgorithmConfig(sampling={"source": ENDPOINT}, advantage={"type": "sft", "ce_weight": 0.5}),
    AlgorithmConfig(
        advantage=EchoAdvantage(roles={"tool": {"alpha": 0.2}, "user role": {"alpha": 0.0}})
    ),
    AlgorithmConfig(
        advantage={"type": "replay_dpo", "dpo_variant": "simpo", "pairs_path": "p.jsonl"}
    ),
    AlgorithmConfig(advantage={"type": "composer", "alpha_sdpo": 0.2, "pairs_per_group": 3}),
]


@pytest.mark.parametrize("config", ROUND_TRIP, ids=lambda c: c.type)
def test_toml_round_trip(config):
    text = config.to_toml()
    again = AlgorithmConfig.from_toml(text)
    assert again == config
    assert again.to_toml() == text
    assert tomllib.loads(text)["advantage"]["type"] == config.type
    lines = text.splitlines()
    assert lines[lines.index("[advantage]") + 1] == f'type = "{config.type}"'


def test_to_toml_writes_the_canonical_form():
    config = AlgorithmConfig(advantage={"type": "opd"}, teacher=ENDPOINT)
    assert config.to_toml() == (
        '[sampling]\nsource = "policy"\ngroup_size = 4\ntemperature = 1.0\n'
        'max_new_tokens = 256\n\n[advantage]\ntype = "opd"\n\n[advantage.model]\n'
        'name = "teacher-1.7b"\nbase_url = "http://127.0.0.1:8000/v1"\n'
    )


def test_from_toml_reads_files(tmp_path):
    path = tmp_path / "algo.toml"
    path.write_text('[advantage]\ntype = "reward"\n')
    assert AlgorithmConfig.from_toml(path).type == "reward"
    assert AlgorithmConfig.from_toml(str(path)).type == "reward"


def test_shipped_configs_cover_every_type():
    shipped = {p.stem for p in CONFIG_DIR.glob("*.toml")}
    assert shipped == {
        "grpo", "max_rl", "reward", "custom", "opd", "opsd", "sdpo", "sft", "echo",
        "replay_dpo", "composer",
    }  # fmt: skip


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.toml")), ids=lambda p: p.stem)
def test_shipped_config_loads_and_round_trips(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no shipped config may warn
        config = AlgorithmConfig.from_toml(path)
        assert config.type == path.stem
        assert AlgorithmConfig.from_toml(config.to_toml()) == config


def test_toml_writer_values():
    text = dumps({"a": {"x": float("inf"), "y": float("-inf"), "s": "tab\there\x7f", "b": True}})
    assert text == '[a]\nx = inf\ny = -inf\ns = "tab\\there\\u007f"\nb = true\n'
    parsed = tomllib.loads(dumps({"t": {"n": float("nan"), "list": [{"k": 1}, {"k": "v"}]}}))
    assert parsed["t"]["list"] == [{"k": 1}, {"k": "v"}]
    assert parsed["t"]["n"] != parsed["t"]["n"]
    assert tomllib.loads(dumps({"empty": {}, "x": {"y": {"z": 1}}})) == {
        "empty": {},
        "x": {"y": {"z": 1}},
    }


def test_folding_leaves_a_passed_sub_config_untouched():
    advantage = OPSDAdvantage()
    config = AlgorithmConfig(advantage=advantage, teacher=LOCAL)
    assert config.advantage.model == LocalFrozenModel(**LOCAL)
    assert advantage.model == "policy"
