"""compose_loss on the tiny model (fast) and on the embedded SmolLM2 (slow)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from composer_replication.batch import Example, PreferencePair, build_batch
from composer_replication.loss import LossComponents, compose_loss
from composer_replication.ops.dpo import dpo_loss
from composer_replication.opsd import generalized_jsd_loss


def _naive_components(model, ref_model, batch, alpha, beta_r, jsd_beta, temperature, dpo_beta):
    """The three channels from full logits, written independently of the chunked path."""
    ids, resp = batch["input_ids"], batch["response_mask"]
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits
    targets = ids[:, 1:].masked_fill(resp[:, 1:] == 0, -100)
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1)
    )
    # SDPO: response tokens are right-aligned in both contexts (build_batch right-pads).
    with torch.no_grad():
        t_logits = model(
            input_ids=batch["ctx_teacher_input_ids"],
            attention_mask=batch["ctx_teacher_attention_mask"],
        ).logits
    s_sel, t_sel = [], []
    for b in range(ids.shape[0]):
        s_pos = resp[b].nonzero().squeeze(-1)
        t_pos = batch["ctx_teacher_response_mask"][b].nonzero().squeeze(-1)
        keep = batch["sdpo_loss_mask"][b, t_pos] != 0  # build_batch: the teacher's layout
        s_sel.append(logits[b, s_pos[keep] - 1])
        t_sel.append(t_logits[b, t_pos[keep] - 1])
    s_sel, t_sel = torch.cat(s_sel)[None], torch.cat(t_sel)[None]
    sdpo = (
        generalized_jsd_loss(s_sel, t_sel, beta=jsd_beta, temperature=temperature, reduction="sum")
        / s_sel.shape[1]
    )

    def seq_logps(m, side):
        ids_s = batch[f"dpo_{side}_input_ids"]
        lg = m(input_ids=ids_s, attention_mask=batch[f"dpo_{side}_attention_mask"]).logits
        lp = torch.log_softmax(lg[:, :-1], -1).gather(-1, ids_s[:, 1:, None]).squeeze(-1)
        return (lp * batch[f"dpo_{side}_response_mask"][:, 1:]).sum(-1)

    with torch.no_grad():
        ref_c, ref_r = seq_logps(ref_model, "chosen"), seq_logps(ref_model, "rejected")
    dpo = dpo_loss(
        seq_logps(model, "chosen"), seq_logps(model, "rejected"), ref_c, ref_r, beta=dpo_beta
    )
    return ce, sdpo, dpo, ce + alpha * sdpo + beta_r * dpo


def test_channels_equal_naive_full_logits_path(tiny):
    model, tokenizer = tiny
    model = copy.deepcopy(model).double()
    ref_model = copy.deepcopy(model)
    with torch.no_grad():  # make the policy differ from its reference so DPO is non-trivial
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    batch = build_batch(tokenizer, ref_model=ref_model)
    comps = compose_loss(
        model,
        batch,
        alpha_sdpo=0.3,
        beta_replay=0.2,
        sdpo_jsd_beta=0.4,
        sdpo_temperature=0.9,
        replay_dpo_beta=0.15,
        ref_model=ref_model,
        chunk_size=7,
    )
    ce, sdpo, dpo, total = _naive_components(model, ref_model, batch, 0.3, 0.2, 0.4, 0.9, 0.15)
    for ours, ref in (
        (comps.lm_ce, ce),
        (comps.sdpo_jsd, sdpo),
        (comps.trace_replay_dpo, dpo),
        (comps.total, total),
    ):
        torch.testing.assert_close(ours, ref.to(ours.dtype), atol=1e-9, rtol=1e-8)
    params = list(model.parameters())
    ours_g = torch.autograd.grad(comps.total, params)
    ref_g = torch.autograd.grad(total, params)
    for a, b in zip(ours_g, ref_g):
        torch.testing.assert_close(a, b, atol=1e-8, rtol=1e-6)


def test_every_channel_finite_and_total_is_weighted_sum(tiny):
    model, tokenizer = tiny
    batch = build_batch(tokenizer, ref_model=model)
    comps = compose_loss(model, batch, alpha_sdpo=0.1, beta_replay=0.05)
    vals = comps.detached()
    assert set(vals) == {"lm_ce", "sdpo_jsd", "trace_replay_dpo", "total"}
    assert all(math.isfinite(v) for v in vals.values())
    assert vals["lm_ce"] > 0 and vals["sdpo_jsd"] > 0
    # reference == policy: every DPO log-ratio is 0, so the loss is exactly log 2
    assert vals["trace_replay_dpo"] == pytest.approx(math.log(2), abs=1e-6)
    assert vals["total"] == pytest.approx(
        vals["lm_ce"] + 0.1 * vals["sdpo_jsd"] + 0.05 * vals["trace_replay_dpo"], rel=1e-6
    )


def test_missing_channels_are_exact_zero_with_grad(tiny):
    model, tokenizer = tiny
    batch = build_batch(tokenizer, examples=[Example("Say hi.", "hi")], pairs=())
    assert "ctx_teacher_input_ids" not in batch and "dpo_chosen_input_ids" not in batch
    comps = compose_loss(model, batch)
    assert float(comps.sdpo_jsd.detach()) == 0.0 and comps.sdpo_jsd.requires_grad
    assert float(comps.trace_replay_dpo.detach()) == 0.0 and comps.trace_replay_dpo.requires_grad
    assert float(comps.total.detach()) == pytest.approx(float(comps.lm_ce.detach()))
    model.zero_grad()
    comps.total.backward()
    assert any(p.grad is not None and torch.any(p.grad != 0) for p in model.parameters())


def _without_reference(batch):
    for key in ("dpo_chosen_ref_logprobs", "dpo_rejected_ref_logprobs"):
        batch.pop(key)
    return batch


def test_reference_logps_are_cached_in_the_batch(tiny):
    model, tokenizer = tiny
    batch = _without_reference(build_batch(tokenizer))
    compose_loss(model, batch, ref_model=model)
    cached = batch["dpo_chosen_ref_logprobs"].clone()
    assert cached.shape == (1,) and not cached.requires_grad
    compose_loss(model, batch)  # no ref_model needed any more: the cache is used
    torch.testing.assert_close(batch["dpo_chosen_ref_logprobs"], cached)
    per_token = build_batch(tokenizer, ref_model=model)["dpo_chosen_ref_logprobs"]
    torch.testing.assert_close(per_token.sum(-1), cached, atol=1e-5, rtol=1e-6)


def test_dpo_without_reference_raises(tiny):
    model, tokenizer = tiny
    batch = _without_reference(build_batch(tokenizer))
    with pytest.raises(ValueError, match="ref_model"):
        compose_loss(model, batch)


def test_a_zero_weight_turns_its_channel_off(tiny):
    """beta_replay=0 needs no reference log-probs; alpha_sdpo=0 runs no teacher forward."""
    model, tokenizer = tiny
    batch = _without_reference(build_batch(tokenizer))
    out = compose_loss(model, batch, beta_replay=0)  # no ref_model, no cached log-probs
    assert float(out.trace_replay_dpo.detach()) == 0.0 and out.trace_replay_dpo.requires_grad
    assert "dpo_chosen_ref_logprobs" not in batch  # nothing was computed for it
    assert float(out.sdpo_jsd.detach()) > 0
    assert float(out.total.detach()) == pytest.approx(
        float(out.lm_ce.detach()) + 0.1 * float(out.sdpo_jsd.detach()), rel=1e-6
    )

    class NoForward(torch.nn.Module):
        def forward(self, *args, **kwargs):
            raise AssertionError("the SDPO teacher ran with alpha_sdpo=0")

    off = compose_loss(model, batch, alpha_sdpo=0, beta_replay=0, teacher_model=NoForward())
    assert float(off.sdpo_jsd.detach()) == 0.0 and off.sdpo_jsd.requires_grad
    assert float(off.total.detach()) == pytest.approx(float(off.lm_ce.detach()), rel=1e-6)
    off.total.backward()


def test_bad_inputs_raise(tiny):
    model, tokenizer = tiny
    batch = build_batch(tokenizer, pairs=())
    with pytest.raises(ValueError, match="input_ids"):
        compose_loss(model, {"attention_mask": batch["attention_mask"]})
    with pytest.raises(ValueError, match="alpha_sdpo"):
        compose_loss(model, batch, alpha_sdpo=-1)
    bad = dict(batch)
    bad["ctx_teacher_response_mask"] = torch.zeros_like(batch["ctx_teacher_response_mask"])
    with pytest.raises(ValueError, match="response tokens"):
        compose_loss(model, bad)


def test_build_batch_keys_and_alignment(tiny):
    _, tokenizer = tiny
    examples = [Example("p1", "r one", hint="h"), Example("a much longer prompt two", "r2")]
    batch = build_batch(
        tokenizer, examples=examples, pairs=[PreferencePair("q", "good", "bad answer")]
    )
    assert set(batch) == {
        "input_ids",
        "attention_mask",
        "response_mask",
        "ctx_teacher_input_ids",
        "ctx_teacher_attention_mask",
        "ctx_teacher_response_mask",
        "sdpo_loss_mask",
        "dpo_chosen_input_ids",
        "dpo_chosen_attention_mask",
        "dpo_chosen_response_mask",
        "dpo_rejected_input_ids",
        "dpo_rejected_attention_mask",
        "dpo_rejected_response_mask",
        "dpo_chosen_ref_logprobs",
        "dpo_rejected_ref_logprobs",
    }
    for b in range(2):
        s = batch["input_ids"][b][batch["response_mask"][b] == 1]
        t = batch["ctx_teacher_input_ids"][b][batch["ctx_teacher_response_mask"][b] == 1]
        assert torch.equal(s, t)
        assert s[-1] == tokenizer.eos_token_id
    assert batch["sdpo_loss_mask"][1].sum() == 0  # no hint on the second example
    assert batch["sdpo_loss_mask"].shape == batch["ctx_teacher_input_ids"].shape
    assert torch.equal(batch["sdpo_loss_mask"][0], batch["ctx_teacher_response_mask"][0])
    with pytest.raises(ValueError, match="max_length"):
        build_batch(tokenizer, examples=[Example("p", "word " * 50)], max_length=10)


@pytest.mark.slow
def test_compose_loss_on_embedded_smollm2():
    from composer_replication.model.loading import load_policy

    model, tokenizer = load_policy()
    model.train()
    batch = build_batch(tokenizer, ref_model=model)
    comps = compose_loss(model, batch)
    vals = comps.detached()
    assert all(math.isfinite(v) for v in vals.values())
    # a trained instruct model puts real mass on short, correct code: CE far below log V
    assert 0 < vals["lm_ce"] < 0.5 * math.log(model.config.vocab_size)
    assert vals["sdpo_jsd"] > 0
    assert vals["trace_replay_dpo"] == pytest.approx(math.log(2), abs=1e-5)
    assert vals["total"] == pytest.approx(
        vals["lm_ce"] + 0.1 * vals["sdpo_jsd"] + 0.05 * vals["trace_replay_dpo"], rel=1e-5
    )
    assert isinstance(comps, LossComponents)


def test_compose_loss_takes_one_loss_config_and_refuses_a_knob_beside_it(tiny):
    """The [loss] table in one argument gives the same components as its knobs; a knob given
    beside it is a one-line error naming where it goes. The signature's defaults are the
    config's (one owner)."""
    import inspect

    from composer_replication.config.loss import LossConfig, loss_default

    for name, parameter in inspect.signature(compose_loss).parameters.items():
        if name in LossConfig.model_fields or name in ("alpha_sdpo", "beta_replay"):
            assert parameter.default == loss_default(name), name
    model, tokenizer = tiny
    model = copy.deepcopy(model).double()
    batch = build_batch(tokenizer, ref_model=model)
    by_knobs = compose_loss(model, batch, sdpo_jsd_beta=0.3, replay_dpo_beta=0.2, chunk_size=5)
    config = LossConfig(sdpo_jsd_beta=0.3, replay_dpo_beta=0.2, chunk_size=5)
    by_config = compose_loss(model, batch, loss_config=config)
    assert by_config.detached() == pytest.approx(by_knobs.detached(), rel=1e-12)
    with pytest.raises(ValueError, match=r"sdpo_temperature=2\.0 given beside loss_config"):
        compose_loss(model, batch, sdpo_temperature=2.0, loss_config=config)
