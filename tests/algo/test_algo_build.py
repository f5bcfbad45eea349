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
