"""Batched sampling: log-probs equal the trainer's recomputation; stops; greedy; padding."""

from __future__ import annotations

import pytest
import torch

from composer_replication.inference.decoding.generate import SamplingSettings, generate
from composer_replication.inference.decoding.padding import left_pad


def _recompute(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    lp = torch.log_softmax(logits / temperature, -1)
    return lp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_logprobs_equal_trainer_logprobs(tiny, temperature):
    model, tok = tiny
    prompts = [tok("def add(a, b):")["input_ids"], tok("x")["input_ids"]]  # different lengths
    gens = generate(
        model,
        tok,
        prompts,
        SamplingSettings(max_new_tokens=12, temperature=temperature),
        generator_seed=0,
    )
    assert [g.prompt_ids for g in gens] == prompts
    for g in gens:
        assert 1 <= len(g.completion_ids) <= 12 and len(g.logprobs) == len(g.completion_ids)
        ref = _recompute(model, g.prompt_ids, g.completion_ids, temperature)
        torch.testing.assert_close(torch.tensor(g.logprobs), ref, atol=1e-4, rtol=1e-4)
        assert g.finish_reason in {"eos", "length", "stop"}


def test_greedy_is_deterministic_and_argmax(tiny):
    model, tok = tiny
    prompt = tok("hello world")["input_ids"]
    a = generate(model, tok, [prompt], SamplingSettings(max_new_tokens=6, temperature=0))
    b = generate(model, tok, [prompt], SamplingSettings(max_new_tokens=6, temperature=0))
    assert a[0].completion_ids == b[0].completion_ids
    ids = torch.tensor([prompt])
    with torch.no_grad():
        first = int(model(input_ids=ids).logits[0, -1].argmax())
    assert a[0].completion_ids[0] == first


def test_stop_string_cuts_completion(tiny):
    model, tok = tiny
    prompt = tok("abc")["input_ids"]
    free = generate(model, tok, [prompt], SamplingSettings(max_new_tokens=10, temperature=0))[0]
    if len(free.completion_ids) < 3:
        pytest.skip("the greedy completion is too short to place a stop string in it")
    stop = tok.decode(free.completion_ids[1:2])
    if not stop.strip():
        pytest.skip("the second greedy token decodes to whitespace only")
    cut = generate(
        model,
        tok,
        [prompt],
        SamplingSettings(max_new_tokens=10, temperature=0, stop_strings=(stop,)),
    )[0]
    assert cut.finish_reason == "stop"
    assert stop in cut.text or stop in tok.decode(cut.completion_ids)
    assert len(cut.completion_ids) <= 2


def test_left_pad_and_bad_settings():
    ids, attn = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and attn.tolist() == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[1], []], 0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingSettings(max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingSettings(temperature=-1)


def test_lora_policy_samples_merged_and_keeps_its_base_weights_exact(tiny):
    import copy

    from peft import LoraConfig, get_peft_model

    from composer_replication.model.parts import lora_merged

    model, tok = tiny
    policy = get_peft_model(
        copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"])
    )
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    prompt = tok("def add(a, b):")["input_ids"]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        unmerged = policy(input_ids=ids).logits
        with lora_merged(policy) as merged_model:
            merged = merged_model(input_ids=ids).logits
            assert all(m.merged for m in policy.modules() if hasattr(m, "merged"))
        torch.testing.assert_close(merged, unmerged, atol=1e-4, rtol=1e-4)
        assert not torch.equal(unmerged, model(input_ids=ids).logits)  # the adapters matter
    gens = generate(policy, tok, [prompt], SamplingSettings(max_new_tokens=8), generator_seed=0)
    ref = _recompute(policy, prompt, gens[0].completion_ids, 1.0)  # unmerged recomputation
    torch.testing.assert_close(torch.tensor(gens[0].logprobs), ref, atol=1e-4, rtol=1e-4)
    for name, p in policy.named_parameters():  # bit-exact base weights, same adapters, flags
        assert torch.equal(p, before[name]), name
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == trainable
    assert not any(getattr(m, "merged", False) for m in policy.modules())
    with lora_merged(model) as same:  # a model without adapters passes through
        assert same is model
