"""Algorithms: rollout groups in, per-token training signal (``TrainingSample``) out.

``AlgorithmConfig`` (sampling + ``advantage.type``) selects one class per algorithm: a
built-in one (``ALGORITHMS``), or a user's ``Algorithm`` subclass named by import path
(``type = "package.module:Class"``; its ``config_class``, a ``UserAdvantage`` subclass,
holds its options and declares what it trains). ``build_algorithm`` constructs it with the
resources it needs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from composer_replication.algo.advantage import (
    align_prefill_logprobs,
    broadcast_to_tokens,
    grpo_advantages,
    length_penalty,
    max_rl_advantages,
)
from composer_replication.algo.base import (
    Algorithm,
    AlgorithmResources,
    FrozenPool,
    rollout_to_sample,
)
from composer_replication.algo.composer import ComposerAlgorithm
from composer_replication.algo.custom import AdvantageInputs, CustomAlgorithm
from composer_replication.algo.echo import EchoAlgorithm
from composer_replication.algo.grpo import GRPOAlgorithm
from composer_replication.algo.max_rl import MaxRLAlgorithm
from composer_replication.algo.opd import OPDAlgorithm
from composer_replication.algo.opsd import OPSDAlgorithm
from composer_replication.algo.replay_dpo import ReplayDPOAlgorithm, tokenize_pair
from composer_replication.algo.reward import RewardAlgorithm
from composer_replication.algo.scoring import (
    EndpointPrefillScorer,
    LocalPrefillScorer,
    PrefillScorer,
)
from composer_replication.algo.sdpo import SDPOAlgorithm
from composer_replication.algo.sft import SFTAlgorithm
from composer_replication.config.advantage import (
    AdvantageConfig,
    ComposerAdvantage,
    CustomAdvantage,
    EchoAdvantage,
    EchoFilter,
    GRPOAdvantage,
    MaxRLAdvantage,
    OPDAdvantage,
    OPSDAdvantage,
    ReplayDPOAdvantage,
    RewardAdvantage,
    RoleWeight,
    SDPOAdvantage,
    SFTAdvantage,
    UserAdvantage,
    user_algorithm,
)
from composer_replication.config.algorithm import AlgorithmConfig, SamplingConfig
from composer_replication.config.references import (
    FrozenEndpoint,
    LocalFrozenModel,
    ModelReference,
)

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls
    for cls in (
        GRPOAlgorithm,
        MaxRLAlgorithm,
        RewardAlgorithm,
        CustomAlgorithm,
        OPDAlgorithm,
        OPSDAlgorithm,
        SDPOAlgorithm,
        SFTAlgorithm,
        EchoAlgorithm,
        ReplayDPOAlgorithm,
        ComposerAlgorithm,
    )
}


def build_algorithm(
    config: AlgorithmConfig | dict[str, Any],
    *,
    tokenizer: Any = None,
    scorer: PrefillScorer | None = None,
    reference_scorer: PrefillScorer | None = None,
    pairs: Sequence[Any] | None = None,
    rng: random.Random | None = None,
    policy: Any = None,
) -> Algorithm:
    """The algorithm ``config.advantage.type`` names (a built-in name, or a user's
    ``"package.module:Class"``), built with what it needs.

    Args:
        config: an ``AlgorithmConfig`` (or a dict validated into one).
        tokenizer: the policy's tokenizer; needed by opsd, sdpo, composer (hinted / demo
            contexts) and to tokenise preference pairs (replay_dpo, composer).
        scorer: prefill scorer of the opd teacher / opsd reference (the frozen pool the
            class declares ``given_as="scorer"``); built from the config's frozen reference
            when omitted (opsd on ``"policy"`` scores with ``policy``).
        reference_scorer: frozen reference for DPO log-probs (replay_dpo, composer); without
            one the trainer's reference model fills them.
        pairs: preference pairs (``DPOPair`` / ``NormalizedDPOPair`` objects or dicts, or
            ``DPOPairTokens``); overrides ``advantage.pairs_path`` (whose default is the
            shipped pairs).
        rng: randomness of pair sampling (default ``random.Random(0)``).
        policy: the live policy (opsd's default reference scores with it in process).

    Raises:
        ValueError: a resource the algorithm needs is missing (the message names it).
    """
    if not isinstance(config, AlgorithmConfig):
        config = AlgorithmConfig.model_validate(config)
    resources = AlgorithmResources(
        tokenizer=tokenizer,
        scorer=scorer,
        reference_scorer=reference_scorer,
        pairs=pairs,
        rng=rng,
        policy=policy,
        temperature=config.sampling.temperature,
    )
    kind = config.advantage.type
    cls = ALGORITHMS[kind] if kind in ALGORITHMS else user_algorithm(kind)
    return cls.build(config, resources)


__all__ = [
    "ALGORITHMS",
    "AdvantageConfig",
    "AdvantageInputs",
    "Algorithm",
    "AlgorithmConfig",
    "AlgorithmResources",
    "ComposerAdvantage",
    "ComposerAlgorithm",
    "CustomAdvantage",
    "CustomAlgorithm",
    "EchoAdvantage",
    "EchoAlgorithm",
    "EchoFilter",
    "EndpointPrefillScorer",
    "FrozenEndpoint",
    "FrozenPool",
    "GRPOAdvantage",
    "GRPOAlgorithm",
    "LocalFrozenModel",
    "LocalPrefillScorer",
    "MaxRLAdvantage",
    "MaxRLAlgorithm",
    "ModelReference",
    "OPDAdvantage",
    "OPDAlgorithm",
    "OPSDAdvantage",
    "OPSDAlgorithm",
    "PrefillScorer",
    "ReplayDPOAdvantage",
    "ReplayDPOAlgorithm",
    "RewardAdvantage",
    "RewardAlgorithm",
    "RoleWeight",
    "SDPOAdvantage",
    "SDPOAlgorithm",
    "SFTAdvantage",
    "SFTAlgorithm",
    "SamplingConfig",
    "UserAdvantage",
    "align_prefill_logprobs",
    "broadcast_to_tokens",
    "build_algorithm",
    "grpo_advantages",
    "length_penalty",
    "max_rl_advantages",
    "rollout_to_sample",
    "tokenize_pair",
]
