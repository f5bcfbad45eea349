"""One loss core: the native step, the trl trainer and ``compose_loss`` agree to 1e-6 on one
fixed batch, because all three call :mod:`composer_replication.ops`; every seed-API option
runs and equals a hand formula; TAID and entropy-aware OPD reach the native step."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from composer_replication.batch import build_batch
from composer_replication.config.loss import LossConfig
from composer_replication.distillation import (
    TAIDScheduler,
    entropy_aware_opd_loss,
    simpo_loss,
    taid_loss,
)
from composer_replication.loss import compose_loss
from composer_replication.opsd import generalized_jsd_loss
from composer_replication.samples.wire import DPOPairTokens, TrainingSample, pack_samples
from composer_replication.training.step import train_step

PROMPT = [1, 9690, 198, 6077, 5453, 30, 2, 198, 1, 4093]
HINTED = [1, 9690, 198, 6077, 5453, 30, 2, 198, 1, 4093, 198, 19161, 803, 24, 81]
COMPLETION = [28, 278, 595, 2, 17, 42, 77, 301]
CHOSEN = ([1, 4093, 198, 300, 301, 302, 2], [0, 0, 0, 1, 1, 1, 1])
REJECTED = ([1, 4093, 198, 400, 401, 2], [0, 0, 0, 1, 1, 1])
REF_CHOSEN, REF_REJECTED = -9.5, -7.25


def _compose_batch():
    ids = torch.tensor([PROMPT + COMPLETION])
    response = torch.tensor([[0] * len(PROMPT) + [1] * len(COMPLETION)])
    t_ids = torch.tensor([HINTED + COMPLETION])
    t_response = torch.tensor([[0] * len(HINTED) + [1] * len(COMPLETION)])
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "response_mask": response,
        "ctx_teacher_input_ids": t_ids,
        "ctx_teacher_attention_mask": torch.ones_like(t_ids),
        "ctx_teacher_response_mask": t_response,
        "sdpo_loss_mask": response.clone(),
        "dpo_chosen_input_ids": torch.tensor([CHOSEN[0]]),
        "dpo_chosen_response_mask": torch.tensor([CHOSEN[1]]),
        "dpo_rejected_input_ids": torch.tensor([REJECTED[0]]),
        "dpo_rejected_response_mask": torch.tensor([REJECTED[1]]),
        "dpo_chosen_ref_logprobs": torch.tensor([REF_CHOSEN]),
        "dpo_rejected_ref_logprobs": torch.tensor([REF_REJECTED]),
    }


def _native_samples():
    n_p, n_t, n_c = len(PROMPT), len(HINTED), len(COMPLETION)
    on_completion = [0.0] * n_p + [1.0] * n_c
    sample = TrainingSample(
        input_ids=PROMPT + COMPLETION,
        loss_mask=[0] * n_p + [1] * n_c,
        inference_logprobs=[0.0] * (n_p + n_c),
        advantages=[0.0] * (n_p + n_c),
        rl_weights=[0.0] * (n_p + n_c),
        ce_weights=on_completion,
        jsd_weights=on_completion,
        teacher_input_ids=HINTED + COMPLETION,
        teacher_index=[-1] * n_p + list(range(n_t, n_t + n_c)),
    )
    pair = DPOPairTokens(
        *CHOSEN, *REJECTED, weight=1.0, ref_chosen_logp=REF_CHOSEN, ref_rejected_logp=REF_REJECTED
    )
    return [sample, TrainingSample(input_ids=[], loss_mask=[], inference_logprobs=[], dpo=pair)]


def _trl_inputs():
    return {
        "prompt_ids": torch.tensor([PROMPT]),
        "prompt_mask": torch.ones(1, len(PROMPT), dtype=torch.long),
        "completion_ids": torch.tensor([COMPLETION]),
        "completion_mask": torch.ones(1, len(COMPLETION), dtype=torch.long),
        "ctx_teacher_input_ids": torch.tensor([HINTED + COMPLETION]),
        "ctx_teacher_attention_mask": torch.ones(
            1, len(HINTED) + len(COMPLETION), dtype=torch.long
        ),
        "sdpo_loss_mask": torch.ones(1, len(COMPLETION), dtype=torch.long),
        "dpo_chosen_input_ids": torch.tensor([CHOSEN[0] + [0]]),
        "dpo_chosen_attention_mask": torch.tensor([[1] * len(CHOSEN[0]) + [0]]),
        "dpo_chosen_response_mask": torch.tensor([CHOSEN[1] + [0]]),
        "dpo_rejected_input_ids": torch.tensor([REJECTED[0] + [0, 0]]),
        "dpo_rejected_attention_mask": torch.tensor([[1] * len(REJECTED[0]) + [0, 0]]),
        "dpo_rejected_response_mask": torch.tensor([REJECTED[1] + [0, 0]]),
        "dpo_chosen_ref_logprobs": torch.tensor([REF_CHOSEN]),
        "dpo_rejected_ref_logprobs": torch.tensor([REF_REJECTED]),
        "dpo_pair_mask": torch.tensor([1]),
    }


def _trl_trainer(model, tokenizer, tmp_path, **kwargs):
    from datasets import Dataset

    from composer_replication.backends.trl.po_presets import make_dr_grpo_config
    from composer_replication.backends.trl.trainer import ComposerReplicationTrainer

    def zero_reward(prompts, completions, **kw):
        return [0.0] * len(completions)

    args = make_dr_grpo_config(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        report_to="none",
        save_strategy="no",
    )
    return ComposerReplicationTrainer(
        model=model,
        reward_funcs=[zero_reward],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "hi"}] * 2),
        processing_class=tokenizer,
        beta_replay=0.0,
        **kwargs,
    )


SETTINGS = [
    {},
    {"sdpo_jsd_beta": 0.2, "sdpo_temperature": 0.7, "sdpo_token_clip": 0.01},
    {"sdpo_wrapper": "taid", "taid_t": 0.6},
    {"sdpo_wrapper": "entropy_opd", "entropy_opd_h_max": 3.0},
    {"dpo_variant": "simpo", "simpo_beta": 2.5, "simpo_gamma": 0.5},
    {"replay_dpo_beta": 0.3},
]


@pytest.mark.parametrize("knobs", SETTINGS, ids=lambda k: ",".join(k) or "defaults")
def test_golden_batch_same_components_through_all_three_paths(tiny, tmp_path, knobs):
    model, tokenizer = tiny
    composed = compose_loss(model, _compose_batch(), **knobs).detached()

    model.zero_grad(set_to_none=True)
    native = train_step(
        model, pack_samples(_native_samples(), max_tokens=4096), LossConfig(**knobs)
    )
    model.zero_grad(set_to_none=True)

    model = copy.deepcopy(model)  # trl may reconfigure the model it is given
    trainer = _trl_trainer(model, tokenizer, tmp_path, **knobs)
    inputs = _trl_inputs()
    with torch.no_grad():
        trl_sdpo = float(trainer._compute_sdpo_loss(model, inputs))
        trl_dpo = float(trainer._compute_trace_replay_loss(model, inputs))

    assert composed["sdpo_jsd"] > 0 and composed["trace_replay_dpo"] > 0
    assert native["loss/jsd"] == pytest.approx(composed["sdpo_jsd"], abs=1e-6, rel=1e-6)
    assert trl_sdpo == pytest.approx(composed["sdpo_jsd"], abs=1e-6, rel=1e-6)
    assert native["loss/dpo"] == pytest.approx(composed["trace_replay_dpo"], abs=1e-6, rel=1e-6)
    assert trl_dpo == pytest.approx(composed["trace_replay_dpo"], abs=1e-6, rel=1e-6)
    assert native["loss/ce"] == pytest.approx(composed["lm_ce"], abs=1e-6, rel=1e-6)


def _logits(model, ids):
    return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def _sdpo_logits(model, batch):
    """Student and teacher logits at the hinted rows' distilled tokens (full logits)."""
    s_logits, t_logits = (
        _logits(model, batch["input_ids"]),
        _logits(model, batch["ctx_teacher_input_ids"]),
    )
    rows_s, rows_t = [], []
    for b in range(batch["input_ids"].shape[0]):
        t_pos = batch["ctx_teacher_response_mask"][b].nonzero().squeeze(-1)
        s_pos = batch["response_mask"][b].nonzero().squeeze(-1)
        keep = batch["sdpo_loss_mask"][b, t_pos] != 0
        rows_s.append(s_logits[b, s_pos[keep] - 1])
        rows_t.append(t_logits[b, t_pos[keep] - 1])
    return torch.cat(rows_s)[None], torch.cat(rows_t)[None].detach()


@pytest.mark.parametrize("variant", ["factorial", "binary_search"])
def test_seed_batch_and_every_compose_loss_option_equal_hand_formulas(tiny, variant):
    model, tokenizer = tiny
    model = copy.deepcopy(model).double()  # float64: tiny divergences compared tightly
    batch = build_batch(tokenizer, seed=3, variant=variant)
    assert batch["sdpo_loss_mask"].shape == batch["ctx_teacher_input_ids"].shape
    ref_c = batch["dpo_chosen_ref_logprobs"].sum(-1)
    ref_r = batch["dpo_rejected_ref_logprobs"].sum(-1)
    assert ref_c.shape == (1,) and float(ref_c) < 0 and float(ref_r) < 0  # seeded stand-ins
    again = build_batch(tokenizer, seed=3, variant=variant)
    assert torch.equal(again["dpo_chosen_ref_logprobs"], batch["dpo_chosen_ref_logprobs"])
    other = build_batch(tokenizer, seed=4, variant=variant)
    assert not torch.equal(other["dpo_chosen_ref_logprobs"], batch["dpo_chosen_ref_logprobs"])

    with torch.no_grad():
        s, t = _sdpo_logits(model, batch)
        labels = batch["input_ids"][:, 1:].masked_fill(batch["response_mask"][:, 1:] == 0, -100)
        logits = _logits(model, batch["input_ids"])[:, :-1]
        ce_smooth = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), label_smoothing=0.1
        )

        def side_logps(side):
            ids = batch[f"dpo_{side}_input_ids"]
            lp = torch.log_softmax(_logits(model, ids)[:, :-1], -1).gather(-1, ids[:, 1:, None])
            mask = batch[f"dpo_{side}_response_mask"][:, 1:]
            return (lp.squeeze(-1) * mask).sum(-1), mask.sum(-1)

        (pc, nc), (pr, nr) = side_logps("chosen"), side_logps("rejected")
        scheduler = TAIDScheduler(10, t_start=0.3)
        expected = {
            "none": generalized_jsd_loss(s, t, beta=0.5, reduction="sum") / s.shape[1],
            "taid": taid_loss(s, t, t=scheduler.t),
            "entropy_opd": entropy_aware_opd_loss(s, t, h_max=2.5),
        }
        simpo = simpo_loss(pc / nc, pr / nr, beta=2.5, gamma=0.4)
        dpo = -torch.nn.functional.logsigmoid(0.2 * ((pc - ref_c) - (pr - ref_r))).mean()

    for wrapper, value in expected.items():
        got = compose_loss(
            model, batch, sdpo_wrapper=wrapper, taid_t=scheduler, entropy_opd_h_max=2.5
        ).sdpo_jsd.detach()
        assert float(got) == pytest.approx(float(value), rel=1e-5, abs=1e-7), wrapper
    parts = compose_loss(
        model,
        batch,
        lm_ce_label_smoothing=0.1,
        dpo_variant="simpo",
        simpo_beta=2.5,
        simpo_gamma=0.4,
        alpha_sdpo=0.0,
    )
    assert float(parts.lm_ce) == pytest.approx(float(ce_smooth), rel=1e-5)
    assert float(parts.trace_replay_dpo) == pytest.approx(float(simpo), rel=1e-5)
    assert float(parts.total) == pytest.approx(float(parts.lm_ce + 0.05 * parts.trace_replay_dpo))
    got_dpo = compose_loss(model, batch, replay_dpo_beta=0.2).trace_replay_dpo
    assert float(got_dpo) == pytest.approx(float(dpo), rel=1e-5)
    clipped = compose_loss(model, batch, sdpo_token_clip=1e-6).sdpo_jsd
    assert float(clipped) == pytest.approx(1e-6, rel=1e-4)  # every token's value is clamped


def test_aligned_sdpo_shapes_put_responses_in_the_same_columns(tiny):
    model, tokenizer = tiny
    plain = build_batch(tokenizer, variant="binary_search")
    aligned = build_batch(tokenizer, variant="binary_search", align_sdpo_shapes=True)
    assert aligned["input_ids"].shape == aligned["ctx_teacher_input_ids"].shape
    assert torch.equal(aligned["response_mask"], aligned["ctx_teacher_response_mask"])
    assert aligned["sdpo_loss_mask"].shape == aligned["input_ids"].shape
    for key in ("input_ids", "ctx_teacher_input_ids"):
        mask = "response_mask" if key == "input_ids" else "ctx_teacher_response_mask"
        assert torch.equal(plain[key][plain[mask] == 1], aligned[key][aligned[mask] == 1])
    a = compose_loss(model, plain).detached()
    b = compose_loss(model, aligned).detached()
    for name in ("lm_ce", "sdpo_jsd", "trace_replay_dpo"):  # left padding changes nothing
        assert b[name] == pytest.approx(a[name], rel=1e-4, abs=1e-6), name


def test_bad_option_values_name_the_value(tiny):
    model, tokenizer = tiny
    batch = build_batch(tokenizer)
    for kwargs, needle in (
        ({"sdpo_wrapper": "kl"}, "sdpo_wrapper='kl'"),
        ({"dpo_variant": "ipo"}, "dpo_variant='ipo'"),
        ({"sdpo_wrapper": "taid"}, "taid_t"),
        ({"lm_ce_label_smoothing": 1.0}, "label_smoothing=1.0"),
    ):
        with pytest.raises(ValueError, match=needle):
            compose_loss(model, batch, **kwargs)
    with pytest.raises(ValueError, match="variant='bogus'"):
        build_batch(tokenizer, variant="bogus")


@pytest.mark.parametrize(
    "knobs",
    [
        {"sdpo_wrapper": "taid", "taid_t": 0.35},
        {"sdpo_wrapper": "entropy_opd", "entropy_opd_h_max": 1.5},
        {"sdpo_wrapper": "none", "sdpo_jsd_beta": 0.9},
    ],
    ids=lambda k: k["sdpo_wrapper"],
)
def test_native_jsd_component_variants_equal_the_standalone_functions(tiny, knobs):
    model, _ = tiny
    samples = _native_samples()[:1]
    metrics = train_step(model, pack_samples(samples, max_tokens=4096), LossConfig(**knobs))
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        n_p, n_t = len(PROMPT), len(HINTED)
        s = _logits(model, torch.tensor([PROMPT + COMPLETION]))[:, n_p - 1 : -1]
        t = _logits(model, torch.tensor([HINTED + COMPLETION]))[:, n_t - 1 : -1]
        kind = knobs["sdpo_wrapper"]
        if kind == "taid":
            expected = taid_loss(s, t, t=knobs["taid_t"])
        elif kind == "entropy_opd":
            expected = entropy_aware_opd_loss(s, t, h_max=knobs["entropy_opd_h_max"])
        else:
            expected = generalized_jsd_loss(s, t, beta=knobs["sdpo_jsd_beta"], reduction="sum")
            expected = expected / s.shape[1]
    assert metrics["tokens/jsd"] == len(COMPLETION)
    assert metrics["loss/jsd"] == pytest.approx(float(expected), rel=1e-5, abs=1e-7)


def test_taid_schedule_in_the_native_loop_moves_t_and_resumes(tiny):
    from composer_replication.training.loss_schedule import LossSchedule

    schedule = LossSchedule(LossConfig(sdpo_wrapper="taid", taid_t_start=0.2), total_steps=4)
    assert schedule.current().taid_t == pytest.approx(0.2)
    seen = []
    for step, loss in enumerate((1.0, 0.5, 0.25, 0.1), 1):
        metrics = {"loss/jsd": loss, "tokens/jsd": 3.0}
        schedule.observe(metrics, step)
        seen.append(metrics["taid/t"])
    assert seen[0] == pytest.approx(0.2) and seen == sorted(seen) and seen[-1] > 0.5
    state = schedule.state_dict()
    fresh = LossSchedule(LossConfig(sdpo_wrapper="taid", taid_t_start=0.2), total_steps=4)
    fresh.load_state_dict(state)
    assert fresh.current().taid_t == schedule.current().taid_t
    fixed = LossSchedule(LossConfig(sdpo_wrapper="taid", taid_t=0.7), total_steps=4)
    assert fixed.current().taid_t == 0.7 and fixed.taid is None
    assert math.isclose(LossSchedule(LossConfig(), 4).current().sdpo_jsd_beta, 0.5)
