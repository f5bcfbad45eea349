"""opd and opsd: ref_kl streams, reference contexts, and reference log-probs after score()."""

from __future__ import annotations

import asyncio

import pytest
import torch

from composer_replication.algo import AlgorithmConfig, LocalPrefillScorer, build_algorithm
from composer_replication.algo.base import REF_CONTEXT, REF_INDEX
from composer_replication.samples.rollouts import Rollout
from composer_replication.samples.wire import pack_samples

MESSAGES = [{"role": "user", "content": "Write add(a, b)."}]
GOOD = "def add(a, b):\n    return a + b"
BAD = "def add(a, b):\n    return a - b"
LOCAL = {"name": "teacher", "local_path": "/unused"}


def _ids(tokenizer, text):
    return [*tokenizer(text, add_special_tokens=False)["input_ids"], 2]  # + <|im_end|>


def _prompt(tokenizer, messages):
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


def _rollout(tokenizer, text, reward, **kw):
    completion = _ids(tokenizer, text)
    return Rollout(
        task_id="add",
        prompt_ids=_prompt(tokenizer, MESSAGES),
        completion_ids=completion,
        inference_logprobs=[-0.5] * len(completion),
        reward=reward,
        prompt_messages=MESSAGES,
        **kw,
    )


def naive_logprobs(model, seq):
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, :-1].double()
    return [0.0, *logits.log_softmax(-1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0].tolist()]


def _close(got, expected):
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        rtol=0,
        atol=2e-5,
    )


def test_opd_assign_and_score(tokenizer, teacher_model):
    config = AlgorithmConfig(advantage={"type": "opd"}, teacher=LOCAL)
    algo = build_algorithm(config, scorer=LocalPrefillScorer(teacher_model))
    multi = Rollout("add", [1, 4093, 198], [31041, 665, 42, 7], [-0.5, -0.25, 0.0, -1.0],
                    completion_mask=[1, 1, 0, 1])  # fmt: skip
    empty = Rollout("add", [1, 4093], [], [])
    samples = algo.process_group([_rollout(tokenizer, BAD, 0.0), multi, empty])
    s0, s1, s2 = samples
    n_prompt = len(_prompt(tokenizer, MESSAGES))
    assert s0.ref_kl_weights == [0.0] * n_prompt + [1.0] * (s0.n_tokens - n_prompt)
    assert s1.ref_kl_weights == [0, 0, 0, 1.0, 1.0, 0.0, 1.0]
    assert s1.rl_weights == [0.0] * 7 and s1.advantages is None
    assert s1.metadata[REF_CONTEXT] == [1, 4093, 198, 31041, 665, 42, 7]
    assert s1.metadata[REF_INDEX] == [-1, -1, -1, 3, 4, 5, 6]
    assert s2.ref_logprobs == [0.0, 0.0] and REF_CONTEXT not in s2.metadata
    with pytest.raises(ValueError, match="ref_logprobs is missing"):
        s1.check_alignment()  # score() must run before shipping

    asyncio.run(algo.score(samples))
    teacher_s1 = naive_logprobs(teacher_model, s1.input_ids)
    _close(s1.ref_logprobs, [0, 0, 0, teacher_s1[3], teacher_s1[4], 0.0, teacher_s1[6]])
    teacher_s0 = naive_logprobs(teacher_model, s0.input_ids)
    _close(s0.ref_logprobs, [0.0] * n_prompt + teacher_s0[n_prompt:])
    assert REF_CONTEXT not in s1.metadata and REF_INDEX not in s1.metadata
    before = list(s1.ref_logprobs)
    asyncio.run(algo.score(samples))  # scoring twice changes nothing
    assert s1.ref_logprobs == before
    for s in samples:
        s.check_alignment()
    (batch,) = pack_samples(samples, max_tokens=4096, split=None)
    assert batch.ref_kl_weights is not None and batch.rl_weights.sum().item() == 0


def test_opsd_demo_context_and_score(tiny):
    model, tokenizer = tiny
    config = AlgorithmConfig(advantage={"type": "opsd"})
    algo = build_algorithm(config, tokenizer=tokenizer, scorer=LocalPrefillScorer(model))
    group = [
        _rollout(tokenizer, GOOD, 1.0, metadata={"reference": "def add(a, b): return a + b"}),
        _rollout(tokenizer, BAD, 0.0),
        _rollout(tokenizer, GOOD, 1.0),  # best, no reference: no signal
    ]
    assert tokenizer.decode(group[0].completion_ids, skip_special_tokens=True) == GOOD
    samples = algo.process_group(group)
    n_prompt = len(group[1].prompt_ids)

    demo_msg = f"Write add(a, b).\n\nHere is a correct solution, for reference:\n{GOOD}"
    demo_prompt = _prompt(tokenizer, [{"role": "user", "content": demo_msg}])
    assert samples[1].metadata[REF_CONTEXT] == demo_prompt + group[1].completion_ids
    n_completion = len(group[1].completion_ids)
    assert samples[1].metadata[REF_INDEX] == [-1] * n_prompt + [
        len(demo_prompt) + j for j in range(n_completion)
    ]
    ref_msg = "Write add(a, b).\n\nHere is a correct solution, for reference:\ndef add(a, b): return a + b"
    ref_prompt = _prompt(tokenizer, [{"role": "user", "content": ref_msg}])
    assert samples[0].metadata[REF_CONTEXT] == ref_prompt + group[0].completion_ids
    assert samples[2].ref_kl_weights == [0.0] * samples[2].n_tokens
    assert samples[2].ref_logprobs == [0.0] * samples[2].n_tokens

    asyncio.run(algo.score(samples))
    expected = naive_logprobs(model, demo_prompt + group[1].completion_ids)[len(demo_prompt) :]
    _close(samples[1].ref_logprobs, [0.0] * n_prompt + expected)
    assert samples[1].advantages is None and samples[1].rl_weights == [0.0] * samples[1].n_tokens
    for s in samples:
        s.check_alignment()
    pack_samples(samples, max_tokens=4096, split=None)


def test_opsd_template_and_missing_messages(tokenizer):
    config = AlgorithmConfig(
        advantage={"type": "opsd", "demo_template": "{content}\n<demo>{demonstration}</demo>"}
    )
    algo = build_algorithm(config, tokenizer=tokenizer, scorer=LocalPrefillScorer(None))
    group = [_rollout(tokenizer, GOOD, 1.0), _rollout(tokenizer, BAD, 0.0)]
    samples = algo.process_group(group)
    text = tokenizer.decode(samples[1].metadata[REF_CONTEXT])
    assert f"Write add(a, b).\n<demo>{GOOD}</demo><|im_end|>" in text
    group[1].prompt_messages = None
    with pytest.raises(ValueError, match="has no prompt_messages"):
        algo.process_group(group)
