"""replay_dpo: pair tokenisation, the pair pool, reference log-probs, pair-only samples."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random

import pytest
import torch

from composer_replication.algo import AlgorithmConfig, LocalPrefillScorer, build_algorithm
from composer_replication.algo.replay_dpo import PairPool, fill_pair_reference_logps, tokenize_pair
from composer_replication.loss import sequence_logps
from composer_replication.samples.rollouts import Rollout
from composer_replication.samples.wire import DPOPairTokens, pack_samples

STATE = [{"role": "user", "content": "Fix the bug in add."}]


@dataclasses.dataclass
class FakeDPOPair:  # the shape of teacher_replay.DPOPair
    state_id: str
    state_messages: list
    chosen: str
    rejected: str
    n_teachers_agreeing: int = 2


def _template(tokenizer, messages, **kw):
    return list(tokenizer.apply_chat_template(messages, **kw)["input_ids"])


def test_tokenize_pair_with_the_chat_template(tokenizer):
    pair = tokenize_pair(
        {"state_messages": STATE, "chosen": "a + b", "rejected": "a - b"}, tokenizer
    )
    prompt = _template(tokenizer, STATE, add_generation_prompt=True)
    chosen = _template(tokenizer, [*STATE, {"role": "assistant", "content": "a + b"}])
    assert pair.chosen_ids == chosen
    assert pair.chosen_mask == [0] * len(prompt) + [1] * (len(chosen) - len(prompt))
    assert tokenizer.decode(pair.chosen_ids[len(prompt) :]) == "a + b<|im_end|>\n"
    assert tokenizer.decode(pair.rejected_ids[len(prompt) :]) == "a - b<|im_end|>\n"
    assert pair.weight == 1.0 and pair.ref_chosen_logp is None


def test_tokenize_pair_forms_agree(tokenizer):
    plain = tokenize_pair(FakeDPOPair("s", STATE, "a + b", "a - b"), tokenizer, weight=0.5)
    normalized = tokenize_pair(
        {
            "state_messages": STATE,
            "chosen_messages": [{"role": "assistant", "content": "a + b"}],
            "rejected_messages": [{"role": "assistant", "content": "a - b"}],
        },
        tokenizer,
        weight=0.5,
    )
    assert plain == normalized
    with pytest.raises(ValueError, match="neither 'rejected' nor 'rejected_messages'"):
        tokenize_pair({"state_messages": STATE, "chosen": "x"}, tokenizer)
    with pytest.raises(ValueError, match="has no state_messages"):
        tokenize_pair({"chosen": "x", "rejected": "y"}, tokenizer)


def test_pair_pool_draws_without_replacement():
    pairs = [DPOPairTokens([1, i], [0, 1], [1, 9], [0, 1]) for i in range(3)]
    pool = PairPool(pairs, random.Random(0))
    first, second = pool.draw(3), pool.draw(3)
    assert sorted(id(p) for p in first) == sorted(id(p) for p in pairs)
    assert sorted(id(p) for p in second) == sorted(id(p) for p in pairs)
    again = PairPool(pairs, random.Random(0))
    assert [id(p) for p in again.draw(6)] == [id(p) for p in first + second]
    assert PairPool([], random.Random(0)).draw(2) == []


def test_replay_dpo_assign_score_and_pack(tiny, tmp_path):
    model, tokenizer = tiny
    path = tmp_path / "pairs.jsonl"
    records = [
        {"state_id": "s0", "state_messages": STATE, "chosen": "a + b", "rejected": "a - b"},
        {"state_id": "s1", "state_messages": STATE, "chosen": "return a+b", "rejected": "pass"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    config = AlgorithmConfig(
        advantage={
            "type": "replay_dpo",
            "pairs_path": str(path),
            "pairs_per_group": 2,
            "beta_replay": 0.5,
        }
    )
    algo = build_algorithm(config, tokenizer=tokenizer, reference_scorer=LocalPrefillScorer(model))
    rollout = Rollout("t", [1, 2], [3], [-0.1])
    samples = algo.process_group([rollout])
    assert len(samples) == 2 and all(s.input_ids == [] for s in samples)
    assert {s.dpo.weight for s in samples} == {0.5}

    asyncio.run(algo.score(samples))
    for pair in (s.dpo for s in samples):
        for side in ("chosen", "rejected"):
            ids = torch.tensor([getattr(pair, f"{side}_ids")])
            mask = torch.tensor([getattr(pair, f"{side}_mask")])
            with torch.no_grad():
                expected = sequence_logps(model, ids, mask).item()
            assert getattr(pair, f"ref_{side}_logp") == pytest.approx(expected, abs=1e-4)
    for s in samples:
        s.check_alignment()
    batches = pack_samples(samples, max_tokens=4096, split=None)
    assert len(batches) == 1 and batches[0].n_rows == 0 and len(batches[0].pairs) == 2


def test_reference_logps_are_cached_and_count_from_token_one(tiny):
    model, _ = tiny
    calls = []

    class CountingScorer(LocalPrefillScorer):
        async def score(self, sequences, start):
            calls.append((sequences, start))
            return await super().score(sequences, start)

    # a response mask that starts at token 0: token 0 has no log-prob and does not count
    pair = DPOPairTokens([1, 5, 6], [1, 1, 1], [1, 7, 8], [1, 1, 1])
    scorer = CountingScorer(model)
    asyncio.run(fill_pair_reference_logps([pair], scorer))
    asyncio.run(fill_pair_reference_logps([pair], scorer))
    assert len(calls) == 1 and calls[0][1] == [1, 1]
    with torch.no_grad():
        expected = sequence_logps(model, torch.tensor([[1, 5, 6]]), torch.tensor([[1, 1, 1]]))
    assert pair.ref_chosen_logp == pytest.approx(expected.item(), abs=1e-4)


def test_simpo_and_no_scorer_leave_reference_alone(tokenizer):
    pairs = [DPOPairTokens([1, 2], [0, 1], [1, 3], [0, 1], weight=7.0)]
    for advantage, scorer in (
        ({"type": "replay_dpo", "dpo_variant": "simpo"}, "x"),
        ({"type": "replay_dpo"}, None),
    ):
        algo = build_algorithm(
            AlgorithmConfig(advantage=advantage), pairs=pairs, reference_scorer=scorer
        )
        samples = algo.process_group([])
        asyncio.run(algo.score(samples))  # "x" would fail if called
        assert samples[0].dpo.ref_chosen_logp is None
        assert samples[0].dpo.weight == 1.0 and pairs[0].weight == 7.0  # a copy took the weight
