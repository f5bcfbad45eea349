"""ComposerReplicationTrainer on real trl: train() on the tiny model with sandbox-graded
rewards; every channel logged, finite, non-zero, and equal to our loss functions
(``loss.compose_loss``) recomputed on the same batch at the same parameters."""

from __future__ import annotations

import math

import pytest
import torch

from composer_replication.backends.trl.po_presets import make_dr_grpo_config
from composer_replication.backends.trl.run import PythonFunctionsReward, train_prompt_dataset
from composer_replication.backends.trl.trainer import (
    ComposerReplicationTrainer,
    default_hint,
)
from composer_replication.envs.python_functions import PythonFunctionsEnv
from composer_replication.loss import compose_loss
from composer_replication.safety import HeldoutSplit

ALPHA, BETA, JSD_BETA, DPO_BETA = 0.5, 0.5, 0.5, 0.1

PAIRS = [
    {
        "state_id": f"s{i}",
        "state_messages": [{"role": "user", "content": f"Write f{i}(x)."}],
        "chosen": f"def f{i}(x):\n    return x + {i}",
        "rejected": f"def f{i}(x):\n    pass",
        "n_teachers_agreeing": 2,
    }
    for i in range(3)
]


def graded_candidate(task, text):
    """What the sandbox grades: the task's reference when the completion's length is a
    multiple of 3, else the stub returning the completion (its tests fail in pytest).
    The tiny random model never writes a function; this keeps real grading in the loop
    and gives every group both solved and failing completions."""
    if len(text) % 3 == 0:
        return task.reference
    return f"{task.prompt.rstrip()}\n    return {text[:40]!r}\n"


class RecordingTrainer(ComposerReplicationTrainer):
    """Recomputes both channels with compose_loss inside the loss hook (same parameters)."""

    records: list[dict[str, float]]

    def _compute_loss(self, model, inputs):
        metrics = self._metrics["train"]
        seen = {k: len(metrics[k]) for k in ("loss/jsd", "loss/dpo", "loss/rl")}
        loss = super()._compute_loss(model, inputs)
        record = {"total": float(loss.detach()), "grpo": metrics["loss/rl"][-1]}
        # With grad enabled, as in training: chunked_head's JSD has a separate no-grad path
        # whose fp32 rounding differs at the 1e-3 relative level for JSDs this small.
        if len(metrics["loss/jsd"]) > seen["loss/jsd"]:
            record["sdpo"] = metrics["loss/jsd"][-1]
            record["sdpo_ref"] = compose_loss(model, _sdpo_batch(inputs), **KW).sdpo_jsd.item()
        if len(metrics["loss/dpo"]) > seen["loss/dpo"]:
            record["dpo"] = metrics["loss/dpo"][-1]
            batch = _dpo_batch(inputs)
            record["dpo_ref"] = compose_loss(model, batch, **KW).trace_replay_dpo.item()
        self.records.append(record)
        return loss


KW = {"sdpo_jsd_beta": JSD_BETA, "sdpo_temperature": 1.0, "replay_dpo_beta": DPO_BETA}


def _sdpo_batch(inputs):
    """The trl batch in compose_loss's layout (batch.py): full rows, masks over them."""
    prompt_zeros = torch.zeros_like(inputs["prompt_mask"])
    n_teacher_prompt = inputs["ctx_teacher_input_ids"].shape[1] - inputs["completion_ids"].shape[1]
    teacher_zeros = torch.zeros((prompt_zeros.shape[0], n_teacher_prompt), dtype=prompt_zeros.dtype)
    return {
        "input_ids": torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
        "attention_mask": torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
        "response_mask": torch.cat([prompt_zeros, inputs["completion_mask"]], 1),
        "ctx_teacher_input_ids": inputs["ctx_teacher_input_ids"],
        "ctx_teacher_attention_mask": inputs["ctx_teacher_attention_mask"],
        "ctx_teacher_response_mask": torch.cat([teacher_zeros, inputs["completion_mask"]], 1),
        "sdpo_loss_mask": torch.cat([prompt_zeros, inputs["sdpo_loss_mask"]], 1),
    }


def _dpo_batch(inputs):
    rows = inputs["dpo_pair_mask"].nonzero().squeeze(-1)
    batch = {k: v[rows] for k, v in inputs.items() if k.startswith("dpo_") and k != "dpo_pair_mask"}
    batch["input_ids"] = batch["dpo_chosen_input_ids"]
    batch["response_mask"] = batch["dpo_chosen_response_mask"]
    return batch


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from composer_replication.model.loading import tiny_policy

    model, tokenizer = tiny_policy(seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    env = PythonFunctionsEnv(grading_workers=2)
    dataset = train_prompt_dataset(env, HeldoutSplit(0.25)).select(range(4))
    reward = PythonFunctionsReward(env, candidate_fn=graded_candidate)
    args = make_dr_grpo_config(
        output_dir=str(tmp_path_factory.mktemp("trl")),
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=12,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=3,
    )
    trainer = RecordingTrainer(
        model=model,
        reward_funcs=[reward],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        alpha_sdpo=ALPHA,
        beta_replay=BETA,
        sdpo_jsd_beta=JSD_BETA,
        replay_dpo_beta=DPO_BETA,
        pairs=PAIRS,
    )
    trainer.records = []
    trainer.train()
    return trainer, before, reward


@pytest.mark.slow
def test_every_channel_is_logged_finite_and_nonzero(trained):
    trainer, _, _ = trained
    steps = [row for row in trainer.state.log_history if "reward" in row]
    assert len(steps) == 2
    for row in steps:
        for key in ("loss/jsd", "loss/dpo", "loss/rl", "loss"):
            assert math.isfinite(row[key]), (key, row)
        assert row["loss/jsd"] > 0 and row["loss/dpo"] > 0
        assert 0 < row["sdpo/error_sites"] < 1 and row["tokens/dpo"] == 2
    # the first step is on the initial model: the DPO loss is exactly log 2
    assert steps[0]["loss/dpo"] == pytest.approx(math.log(2), abs=1e-6)


@pytest.mark.slow
def test_channels_equal_compose_loss_on_the_same_batch(trained):
    trainer, _, _ = trained
    records = trainer.records
    assert any("sdpo" in r for r in records) and any("dpo" in r for r in records)
    for r in records:
        if "sdpo" in r:
            assert r["sdpo"] == pytest.approx(r["sdpo_ref"], rel=1e-6)
        if "dpo" in r:
            assert r["dpo"] == pytest.approx(r["dpo_ref"], rel=1e-6)
        expected = r["grpo"] + ALPHA * r.get("sdpo", 0.0) + BETA * r.get("dpo", 0.0)
        assert r["total"] == pytest.approx(expected, rel=1e-5, abs=1e-7)


@pytest.mark.slow
def test_training_changes_parameters_and_rewards_come_from_the_sandbox(trained):
    trainer, before, reward = trained
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert changed
    # the last call graded in the real sandbox: solved completions pass every test, failing
    # ones carry the failing tests as feedback
    assert reward.last_info and all(info["total"] >= 3 for info in reward.last_info)
    for info, feedback in zip(reward.last_info, reward.last_feedback):
        if info["passed"] == info["total"]:
            assert feedback is None
        else:
            assert "FAILED test_" in feedback


def test_default_hint_classifies_pytest_output():
    output = "E       assert None == 15\ntest_solution.py:3: AssertionError\n1 failed in 0.1s"
    hint = default_hint(output)
    assert hint.startswith("The run failed with:") and "AssertionError" in hint


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alpha_sdpo": -1.0}, "alpha_sdpo=-1.0 must be >= 0"),
        ({"beta_replay": -0.5}, "beta_replay=-0.5 must be >= 0"),
        ({"sdpo_jsd_beta": 1.5}, "sdpo_jsd_beta=1.5 must be in [0, 1]"),
        ({"replay_dpo_beta": 0.0}, "replay_dpo_beta=0.0 must be > 0"),
        ({"sdpo_token_clip": 0.0}, "sdpo_token_clip=0.0 must be > 0"),
        ({"pairs_per_prompt": 0}, "pairs_per_prompt=0 must be >= 1"),
    ],
)
def test_bad_settings_raise_before_trl_starts(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ComposerReplicationTrainer(model=None, **kwargs)


def test_sequence_logprobs_sums_the_response_tokens_log_probs(tiny):
    """The trainer's static helper against log_softmax + gather by hand, with padding."""
    model, _ = tiny
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=gen)
    attention = torch.ones_like(ids)
    attention[1, 7:] = 0  # the second row is padded at its end
    response = torch.zeros_like(ids)
    response[0, 4:] = 1
    response[1, 3:7] = 1
    got = ComposerReplicationTrainer._sequence_logprobs(model, ids, response, attention)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits.double()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    want = (logp * response[:, 1:]).sum(-1)
    assert got.shape == (2,)
    assert torch.allclose(got.double(), want, atol=1e-4)
