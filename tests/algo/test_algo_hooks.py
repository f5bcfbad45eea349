"""The algorithm's stages: process_group drives check_group -> build_samples -> finalize_group
in order, score runs score_samples with bounded concurrency, and frozen pools are declared on
the class and connected by setup."""

from __future__ import annotations

import asyncio

import pytest

from composer_replication.algo import (
    Algorithm,
    AlgorithmConfig,
    AlgorithmResources,
    EndpointPrefillScorer,
    FrozenPool,
    GRPOAlgorithm,
    LocalPrefillScorer,
    OPDAlgorithm,
    build_algorithm,
)
from composer_replication.algo.base import REF_CONTEXT
from composer_replication.config.advantage import RewardAdvantage
from composer_replication.samples.rollouts import Rollout

ENDPOINT = {"name": "teacher", "base_url": "http://127.0.0.1:9/v1"}


def _rollout(reward: float, completion=(10, 11), task_id="t", **kw) -> Rollout:
    return Rollout(
        task_id=task_id,
        prompt_ids=[1, 2],
        completion_ids=list(completion),
        inference_logprobs=[-0.5] * len(completion),
        reward=reward,
        **kw,
    )


class RecordingAlgorithm(Algorithm):
    """Overrides every hook, recording each call (it reads the reward type's config)."""

    config_class = RewardAdvantage

    def __init__(self, config: AlgorithmConfig) -> None:
        super().__init__(config)
        self.calls: list[str] = []

    def check_group(self, group):
        self.calls.append(f"check_group:{len(group)}")
        super().check_group(group)

    def build_samples(self, rollout):
        self.calls.append(f"build_samples:{rollout.reward}")
        return super().build_samples(rollout)

    def observation_weights(self, rollout):
        self.calls.append(f"observation_weights:{rollout.reward}")
        return [0.0 if m else 0.25 for m in rollout.completion_mask]

    def finalize_group(self, group, samples):
        self.calls.append(f"finalize_group:{len(samples)}")
        for sample in samples:
            sample.advantages = [0.0] * sample.n_tokens
        return samples

    async def score_samples(self, samples):
        self.calls.append(f"score_samples:{len(samples)}")


def test_process_group_runs_the_hooks_in_order():
    algo = RecordingAlgorithm(AlgorithmConfig(advantage={"type": "reward"}))
    group = [_rollout(1.0, completion_mask=[1, 0]), _rollout(0.0)]
    samples = algo.process_group(group)
    assert algo.calls == [
        "check_group:2",
        "build_samples:1.0",
        "observation_weights:1.0",
        "build_samples:0.0",
        "observation_weights:0.0",
        "finalize_group:2",
    ]
    # the default build_samples: the plain sample, ce where observation_weights gives any
    assert samples[0].input_ids == [1, 2, 10, 11] and samples[0].source == "reward"
    assert samples[0].ce_weights == [0.0, 0.0, 0.0, 0.25]
    assert samples[1].ce_weights is None  # no observation tokens
    algo.calls.clear()
    asyncio.run(algo.score(samples * 9))  # 18 samples: chunks of 8, 8, 2
    assert algo.calls == ["score_samples:8", "score_samples:8", "score_samples:2"]

    algo.calls.clear()
    with pytest.raises(ValueError, match="empty group"):
        algo.process_group([])
    assert algo.calls == ["check_group:0"]  # nothing is built from a refused group
    # assign(group), the first public name, is the same stage
    algo.calls.clear()
    again = algo.assign(group)
    assert [s.input_ids for s in again] == [s.input_ids for s in samples]
    assert algo.calls[0] == "check_group:2" and algo.calls[-1] == "finalize_group:2"


def test_build_samples_checks_the_observation_weights():
    class Short(GRPOAlgorithm):
        def observation_weights(self, rollout):
            return [0.5]

    with pytest.raises(ValueError, match=r"gave 1 weights for the 2 completion tokens"):
        Short(AlgorithmConfig()).process_group([_rollout(1.0)])


def test_group_credit_needs_one_sample_per_rollout():
    class Twice(GRPOAlgorithm):
        def build_samples(self, rollout):
            return super().build_samples(rollout) * 2

    with pytest.raises(ValueError, match=r"build_samples made 4 samples for 2 rollouts"):
        Twice(AlgorithmConfig()).process_group([_rollout(1.0), _rollout(0.0)])


class CountingScorer:
    """A prefill scorer whose log-prob of token t is ``-t / 100``; it counts its calls in
    flight. Each call yields to the event loop a few times, as a request to an endpoint does,
    so calls that are allowed to overlap do."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.peak = 0
        self.calls = 0

    async def score(self, sequences: list[list[int]], start: list[int]) -> list[list[float]]:
        self.calls += 1
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            for _ in range(3):
                await asyncio.sleep(0)
            return [[-t / 100 for t in seq[s:]] for seq, s in zip(sequences, start)]
        finally:
            self.in_flight -= 1


@pytest.mark.parametrize(
    ("limit", "chunk", "peak", "calls"),
    [(3, 2, 3, 6), (1, 4, 1, 3), (8, 8, 2, 2)],
)
def test_score_keeps_to_max_concurrent_scoring(limit, chunk, peak, calls):
    scorer = CountingScorer()
    algo = build_algorithm(
        AlgorithmConfig(advantage={"type": "opd", "model": ENDPOINT}), scorer=scorer
    )
    algo.max_concurrent_scoring, algo.scoring_chunk_size = limit, chunk
    samples = []
    for i in range(11):  # 11 one-rollout groups of distinct completions
        samples += algo.process_group([_rollout(0.0, completion=(10 + i, 20 + i), task_id=f"t{i}")])
    asyncio.run(algo.score(samples))
    assert (scorer.peak, scorer.calls, scorer.in_flight) == (peak, calls, 0)
    for i, sample in enumerate(samples):  # each sample got its own teacher log-probs
        assert sample.ref_logprobs == [0.0, 0.0, -(10 + i) / 100, -(20 + i) / 100]
        assert REF_CONTEXT not in sample.metadata


def test_score_refuses_a_concurrency_below_one():
    algo = RecordingAlgorithm(AlgorithmConfig(advantage={"type": "reward"}))
    algo.max_concurrent_scoring = 0
    with pytest.raises(ValueError, match="max_concurrent_scoring = 0 must both be >= 1"):
        asyncio.run(algo.score([]))


def test_setup_connects_the_declared_pools(tiny):
    model, tokenizer = tiny
    opd = build_algorithm(AlgorithmConfig(advantage={"type": "opd", "model": ENDPOINT}))
    assert list(opd.connected_pools) == ["teacher"]
    assert isinstance(opd.connected_pools["teacher"], EndpointPrefillScorer)
    assert opd.scorer is opd.connected_pools["teacher"]

    # opsd's default reference is the live policy, scoring in process at the sampling temperature
    config = AlgorithmConfig(sampling={"temperature": 0.7}, advantage={"type": "opsd"})
    opsd = build_algorithm(config, tokenizer=tokenizer, policy=model)
    (reference,) = opsd.connected_pools.values()
    assert isinstance(reference, LocalPrefillScorer)
    assert (reference.model, reference.temperature) == (model, 0.7)

    # a scorer the run hands over wins over the config's model
    given = CountingScorer()
    opd = build_algorithm(
        AlgorithmConfig(advantage={"type": "opd", "model": ENDPOINT}), scorer=given
    )
    assert opd.connected_pools == {"teacher": given}

    # the DPO reference is optional: without one the trainer's reference model scores
    dpo = build_algorithm(AlgorithmConfig(advantage={"type": "replay_dpo"}), tokenizer=tokenizer)
    assert dpo.connected_pools == {} and dpo.reference_scorer is None


def test_a_pool_is_connected_by_name():
    config = AlgorithmConfig(advantage={"type": "opd", "model": ENDPOINT})
    algo = OPDAlgorithm(config)  # built directly: nothing connected yet
    samples = algo.process_group([_rollout(0.0)])
    with pytest.raises(ValueError, match=r"frozen pool 'teacher' is not connected"):
        asyncio.run(algo.score(samples))
    with pytest.raises(ValueError, match=r"declares the frozen pools \['teacher'\], not 'judge'"):
        algo.connect_frozen_pool("judge", CountingScorer())
    algo.connect_frozen_pool("teacher", CountingScorer())
    asyncio.run(algo.score(samples))
    assert samples[0].ref_logprobs == [0.0, 0.0, -0.1, -0.11]


def test_a_subclass_declares_its_own_pool():
    class Judged(RecordingAlgorithm):
        frozen_pools = (
            FrozenPool("judge", given_as="scorer", error_if_missing="Judged needs scorer="),
        )

    config = AlgorithmConfig(advantage={"type": "reward"})
    with pytest.raises(ValueError, match="Judged needs scorer="):
        Judged.build(config, AlgorithmResources())
    judge = CountingScorer()
    algo = Judged.build(config, AlgorithmResources(scorer=judge))
    assert algo.connected_pools == {"judge": judge} and algo.frozen_pool("judge") is judge
