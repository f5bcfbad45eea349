"""ComposerReplicationTrainer(..., data_collator=ComposerDataCollator(...)) as documented: the
collator's teacher contexts and preference pairs feed the SDPO and DPO channels (equal to
compose_loss on the collator's batch), with traces as the training dataset."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from composer_replication.backends.trl.data_collator import CollatorConfig, ComposerDataCollator
from composer_replication.backends.trl.po_presets import make_dr_grpo_config
from composer_replication.backends.trl.trainer import ComposerReplicationTrainer, TraceReward
from composer_replication.hint_generator import dispatch
from composer_replication.loss import compose_loss


def seed_trace(i: int, *, tool_error: bool) -> dict:
    """A trace in the documented TraceExample shape: a tool call, its (failing) result, the
    fix; even traces carry a teacher preference pair."""
    turns = [
        {"role": "user", "content": f"Make test_{i} pass."},
        {"role": "assistant", "content": "", "tool_call": {"name": "Bash", "arguments": "{}"}},
        {"role": "tool", "content": "1 failed" if tool_error else "1 passed"},
        {"role": "assistant", "content": f"def f(x):\n    return x + {i}"},
    ]
    if tool_error:
        turns[2]["tool_error"] = f"E   assert f({i}) == {i + 1}"
        turns[2]["error_meta"] = {"error_kind": "runtime_error", "tool_name": "Bash"}
    pairs = [{"chosen": f"return x + {i}", "rejected": "pass"}] if i % 2 == 0 else None
    return {"trace_id": f"t{i}", "turns": turns, "final_reward": float(i % 2), "dpo_pairs": pairs}


TRACES = [seed_trace(i, tool_error=i < 3) for i in range(4)]


@pytest.fixture(scope="module")
def documented(tmp_path_factory):
    from datasets import Dataset

    from composer_replication.model.loading import tiny_policy

    my_model, tok = tiny_policy(seed=0)
    ds = Dataset.from_list(TRACES)
    my_grpo_args = make_dr_grpo_config(
        output_dir=str(tmp_path_factory.mktemp("trl-collator")),
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=0,
    )
    my_collator = ComposerDataCollator(
        tokenizer=tok, config=CollatorConfig(hint_generator=dispatch, pad_token_id=tok.pad_token_id)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = ComposerReplicationTrainer(
            model=my_model,
            args=my_grpo_args,
            train_dataset=ds,
            data_collator=my_collator,
            alpha_sdpo=0.1,
            beta_replay=0.05,
        )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return trainer, my_collator, [str(w.message) for w in caught], before


@pytest.mark.slow
def test_the_collator_feeds_both_extra_channels(documented):
    trainer, _, messages, before = documented
    assert not [m for m in messages if "that channel stays 0" in m]
    assert [m for m in messages if "no reward_funcs" in m]  # GRPO has no verifier here
    assert isinstance(trainer.reward_funcs[0], TraceReward)
    steps = [row for row in trainer.state.log_history if "loss/rl" in row]
    assert len(steps) == 2
    for row in steps:
        assert row["loss/jsd"] > 0
        assert row["loss/jsd"] == pytest.approx(row["loss/jsd/traces"], rel=1e-6)
        assert row["loss/dpo"] > 0 and row["tokens/dpo"] >= 1
        assert row["sdpo/trace_error_sites"] > 0
        assert all(math.isfinite(row[k]) for k in ("loss", "loss/jsd", "loss/dpo"))
    # the first step runs the initial model: the pairs' cached reference log-probs are its own
    assert steps[0]["loss/dpo"] == pytest.approx(math.log(2), abs=1e-6)
    # one reference entry per distinct pair of the dataset, scored at construction
    assert len(trainer._trace_refs) == 2
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert changed


@pytest.mark.slow
def test_trace_channels_equal_compose_loss_on_the_collator_batch(documented):
    trainer, collator, _, _ = documented
    # a generation batch: each trace repeated num_generations times, as trl's sampler does
    rows = [dict(t, prompt=[]) for t in TRACES[:2] for _ in range(2)]
    output = {"completion_ids": torch.zeros((len(rows), 1), dtype=torch.long)}
    pairs = trainer._trace_fields(rows, output, "eval")
    # one trace's rows only on its first row
    assert output["trace_sdpo_loss_mask"][[1, 3]].sum() == 0
    batch = collator(TRACES[:2])
    model = trainer.model
    with torch.no_grad():
        got = trainer._compute_trace_sdpo_loss(model, output)
        ref = compose_loss(model, batch, alpha_sdpo=1.0, beta_replay=0.0, sdpo_jsd_beta=0.5)
    assert float(got) == pytest.approx(float(ref.sdpo_jsd), rel=1e-6)
    assert float(got) > 0
    # the trace's pair, with the reference log-probs cached at construction
    (pair,) = pairs
    assert (pair.ref_chosen_logp, pair.ref_rejected_logp) == trainer._trace_refs[
        (tuple(pair.chosen_ids), tuple(pair.rejected_ids))
    ]


def test_trace_reward_reads_the_recorded_reward():
    reward = TraceReward()
    columns = {k: [t[k] for t in TRACES] for k in TRACES[0]}
    assert reward(["p"] * 4, ["c"] * 4, **columns, trainer_state=None) == [0.0, 1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="has no reward 'pass'"):
        TraceReward("pass")(["p"], ["c"], **{k: [v[0]] for k, v in columns.items()})
