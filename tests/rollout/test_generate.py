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


def _lora_policy(model):
    """A copy of ``model`` with r=4 adapters on q_proj and up_proj that change its outputs."""
    import copy

    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(
        copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"])
    )
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return policy


def test_lora_policy_samples_merged_and_keeps_its_base_weights_exact(tiny):
    from composer_replication.model.parts import lora_merged

    model, tok = tiny
    policy = _lora_policy(model)
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


def test_packed_sampling_folds_lora_adapters_into_its_own_copy(tiny):
    """On the CPU's packed path the adapters are folded into the packed copy (no merge of
    the live weights, no saved copy of them): the same tokens and log-probs, bit for bit,
    as sampling the merged model, and the live layers are never merged."""
    import copy

    from composer_replication.inference.decoding.generate import DecodeOptions
    from composer_replication.inference.decoding.packed_linear import (
        folded_lora_weight,
        packed_linear_available,
    )

    model, tok = tiny
    if not packed_linear_available(model):
        pytest.skip("no oneDNN packed linear in this torch build")
    policy = _lora_policy(model)
    merged = copy.deepcopy(policy).merge_and_unload()
    layer = next(m for m in policy.modules() if hasattr(m, "lora_A") and m.lora_A)
    merged_weight = copy.deepcopy(layer)
    merged_weight.merge()
    weight, _ = folded_lora_weight(layer)
    assert torch.equal(weight, merged_weight.get_base_layer().weight)
    assert folded_lora_weight(layer.get_base_layer()) is None  # not a LoRA layer

    merges = []
    for module in policy.modules():
        if hasattr(module, "merge") and hasattr(module, "lora_A"):
            module.merge = lambda *a, _m=merges, **k: _m.append(1)
    prompts = [tok("def add(a, b):")["input_ids"], tok("def sub(a, b):")["input_ids"]]
    settings = SamplingSettings(max_new_tokens=8, temperature=1.0)
    general = DecodeOptions(loop="general")
    folded = generate(policy, tok, prompts, settings, decode=general, generator_seed=3)
    reference = generate(merged, tok, prompts, settings, decode=general, generator_seed=3)
    assert [g.completion_ids for g in folded] == [g.completion_ids for g in reference]
    assert [g.logprobs for g in folded] == [g.logprobs for g in reference]
    assert merges == []  # the live layers were never merged
