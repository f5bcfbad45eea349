"""build_algorithm: one class per type, and clear errors for missing resources."""

from __future__ import annotations

import pytest

from composer_replication.algo import (
    ALGORITHMS,
    AlgorithmConfig,
    EndpointPrefillScorer,
    GRPOAlgorithm,
    OPDAlgorithm,
    build_algorithm,
)

ENDPOINT = {"name": "teacher", "base_url": "http://127.0.0.1:9/v1"}


def test_every_type_has_a_class():
    assert set(ALGORITHMS) == {
        "grpo", "max_rl", "reward", "custom", "opd", "opsd", "sdpo", "sft", "echo",
        "replay_dpo", "composer",
    }  # fmt: skip
    components = {name: cls.components for name, cls in ALGORITHMS.items()}
    assert components["composer"] == ("rl", "jsd", "dpo")
    assert components["opd"] == components["opsd"] == ("ref_kl",)
    assert components["echo"] == ("rl", "ce")


def test_every_algorithm_agrees_with_its_config_declarations():
    """Each built-in algorithm class and its config class are one declaration: the same
    name, the config's ``trains`` as the class's components, known component and backend
    names; the derived name sets are what the classes declare."""
    from composer_replication.config.advantage import (
        BACKENDS,
        BUILTIN_ADVANTAGES,
        GROUP_RELATIVE,
        RL_TYPES,
    )
    from composer_replication.config.loss import COMPONENTS

    assert set(ALGORITHMS) == set(BUILTIN_ADVANTAGES)
    for name, cls in ALGORITHMS.items():
        config_class = BUILTIN_ADVANTAGES[name]
        assert cls.config_class is config_class and cls.name == name
        assert cls.components == config_class.trains and config_class.trains
        assert set(config_class.trains) <= set(COMPONENTS)
        assert "native" in config_class.backends and config_class.backends <= set(BACKENDS)
        assert isinstance(config_class.group_relative, bool)
    assert {"grpo", "max_rl", "sdpo", "composer", "echo"} == GROUP_RELATIVE
    assert {"grpo", "max_rl", "reward", "custom", "sdpo", "echo", "composer"} == RL_TYPES
    backends = {n: sorted(c.backends - {"native"}) for n, c in BUILTIN_ADVANTAGES.items()}
    assert backends == {
        "grpo": ["prime_rl", "trl"], "max_rl": ["prime_rl"], "reward": [], "custom": [],
        "opd": ["prime_rl"], "opsd": ["prime_rl"], "sdpo": ["trl"], "sft": ["prime_rl"],
        "echo": ["prime_rl"], "replay_dpo": [], "composer": ["trl"],
    }  # fmt: skip


def test_build_from_dict_and_default():
    algo = build_algorithm({"advantage": {"type": "grpo"}})
    assert isinstance(algo, GRPOAlgorithm) and algo.config.sampling.group_size == 4


def test_opd_builds_an_endpoint_scorer_from_the_config():
    algo = build_algorithm(AlgorithmConfig(advantage={"type": "opd", "model": ENDPOINT}))
    assert isinstance(algo, OPDAlgorithm)
    assert isinstance(algo.scorer, EndpointPrefillScorer)
    assert (algo.scorer.url, algo.scorer.model, algo.scorer.mode) == (
        "http://127.0.0.1:9/v1/completions",
        "teacher",
        "vllm",
    )


@pytest.mark.parametrize(
    ("advantage", "message"),
    [
        ({"type": "opsd"}, "opsd needs tokenizer="),
        ({"type": "sdpo"}, "sdpo needs tokenizer="),
        ({"type": "composer"}, "composer needs tokenizer="),
        ({"type": "replay_dpo"}, "tokenising preference pairs needs tokenizer="),
    ],
)
def test_missing_resources_are_named(advantage, message):
    with pytest.raises(ValueError, match=message):
        build_algorithm(AlgorithmConfig(advantage=advantage))


def test_opsd_on_policy_needs_a_policy_scorer(tokenizer):
    with pytest.raises(ValueError, match="LocalPrefillScorer\\(policy_model\\)"):
        build_algorithm(AlgorithmConfig(advantage={"type": "opsd"}), tokenizer=tokenizer)


def test_pairs_need_a_tokenizer():
    record = {"state_messages": [{"role": "user", "content": "x"}], "chosen": "a", "rejected": "b"}
    with pytest.raises(ValueError, match="needs tokenizer="):
        build_algorithm(AlgorithmConfig(advantage={"type": "replay_dpo"}), pairs=[record])
