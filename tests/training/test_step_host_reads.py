"""The trainer step keeps a GPU busy: it reads device values on the host once per optimizer
step, whatever the number of micro-batches (counted on the CPU with ``HostReads``), and
what it knows from packing instead (counts, row indices, pair rows) matches the tensors."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from composer_replication.config.run import RunConfig
from composer_replication.model.parts import last_hidden_states
from composer_replication.ops.pairs import fill_reference_logps, pad_rows
from composer_replication.ops.self_distillation import aligned_from_index
from composer_replication.samples.wire import TrainingSample, pack_samples
from composer_replication.testing.host_reads import HostReads
from composer_replication.training.learner import Learner, adamw_kernel
from composer_replication.training.setup import kl_to_initial_sum
from composer_replication.training.step import COMPONENTS, train_step

sys.path.insert(0, str(Path(__file__).parent))
from test_step import _jsd_sample, _pair, _rl_sample


def _bundle(seed: int) -> list[TrainingSample]:
    """One sample of every component kind, rows of different lengths (as rollouts are: rows
    of one length have no padding, and the model then reads its 2-D mask once itself)."""
    seed = 100 * seed
    ce = _rl_sample(seed + 4, n_completion=5)
    ce.ce_weights = [0.5 * m for m in ce.loss_mask]
    ref = _rl_sample(seed + 5, n_completion=9)
    ref.ref_kl_weights = list(ref.loss_mask)
    ref.ref_logprobs = [v - 0.1 for v in ref.inference_logprobs]
    return [
        _rl_sample(seed + 1, n_completion=6),
        _jsd_sample(seed + 2),
        _jsd_sample(seed + 3, hint_len=5),
        ce,
        ref,
        TrainingSample([], [], [], dpo=_pair(seed + 6)),  # no cached reference: scored here
    ]


def _micro_batches(n: int) -> list:
    """``n`` micro-batches, one per bundle, packed on the host (outside any counted block)."""
    batches = [
        mb for k in range(n) for mb in pack_samples(_bundle(k), max_tokens=10_000, split=None)
    ]
    assert len(batches) == n
    return batches


@pytest.mark.parametrize("n_micro_batches", [1, 5])
def test_train_step_reads_the_device_once_whatever_the_micro_batches(tiny, n_micro_batches):
    model, reference = copy.deepcopy(tiny[0]), copy.deepcopy(tiny[0])
    batches = _micro_batches(n_micro_batches)
    with HostReads() as reads:
        metrics = train_step(model, batches, reference=reference)
    assert reads.total == 1, dict(reads.counts)
    assert all(metrics[f"tokens/{c}"] > 0 for c in COMPONENTS)
    assert "ref_kl/mean" in metrics


@pytest.mark.parametrize("n_micro_batches", [1, 5])
def test_learner_update_reads_the_device_once(tiny, n_micro_batches):
    config = RunConfig()
    learner = Learner(
        copy.deepcopy(tiny[0]),
        model=config.model,
        optim=config.optim,
        loss=config.loss,
        steps=config.steps,
    )
    assert learner.optim_config.grad_clip is not None  # the norm is read with the sums
    for step in (1, 2):  # the first step creates the optimizer state
        batches = _micro_batches(n_micro_batches)
        with HostReads() as reads:
            row = learner.update(batches, step)
        assert reads.total == 1, dict(reads.counts)
    assert row["grad_norm"] > 0 and row["tokens/dpo"] == n_micro_batches


def test_reference_logps_scored_in_the_step_are_cached_with_its_read(tiny):
    model, reference = copy.deepcopy(tiny[0]), copy.deepcopy(tiny[0])
    batches = _micro_batches(2)
    pairs = [p for mb in batches for p in mb.pairs]
    assert all(p.ref_chosen_logp is None for p in pairs)
    train_step(model, batches, reference=reference)
    scored = [copy.deepcopy(p) for p in pairs]
    for p in scored:
        p.ref_chosen_logp = p.ref_rejected_logp = None
    for pair in scored:  # one pair per micro-batch: scored alone, as in the step
        fill_reference_logps(reference, [pair])
    assert [(p.ref_chosen_logp, p.ref_rejected_logp) for p in pairs] == [
        (p.ref_chosen_logp, p.ref_rejected_logp) for p in scored
    ]


def test_kl_to_initial_reads_the_device_once(tiny):
    policy, initial = copy.deepcopy(tiny[0]), copy.deepcopy(tiny[0])
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    batches = _micro_batches(3)
    with HostReads() as reads:
        total, count = kl_to_initial_sum(policy, initial, batches, 1.0)
    assert reads.total == 1, dict(reads.counts)
    assert total > 0 and count == sum(int((mb.loss_mask[:, 1:] != 0).sum()) for mb in batches)


def test_packing_records_what_the_step_would_read_from_the_tensors():
    (mb,) = _micro_batches(1)
    mask = mb.loss_mask[:, 1:] != 0
    assert mb.counts == {
        "rl": int((mask & (mb.rl_weights[:, 1:] != 0)).sum()),
        "ce": int((mb.ce_weights[:, 1:] != 0).sum()),
        "ref_kl": int((mask & (mb.ref_kl_weights[:, 1:] != 0)).sum()),
        "jsd": int((mb.jsd_weights[:, 1:] != 0).sum()),
        "dpo": 1,
    }
    needed = mask | (mb.ce_weights[:, 1:] != 0)
    assert torch.equal(mb.head_rows, needed.reshape(-1).nonzero().squeeze(-1))
    assert torch.equal(mb.trainable_rows, mask.reshape(-1).nonzero().squeeze(-1))
    tokens = aligned_from_index(mb.jsd_weights, mb.teacher_index)
    rows, student, teacher, slots = mb.jsd_tokens
    assert torch.equal(rows, tokens.rows) and torch.equal(student, tokens.student)
    assert torch.equal(teacher, tokens.teacher)
    unique_rows, inverse = torch.unique(tokens.rows, return_inverse=True)
    assert torch.equal(mb.jsd_rows, unique_rows) and torch.equal(slots, inverse)
    assert [mb.row_samples[r].teacher_input_ids for r in mb.jsd_rows.tolist()] == (
        mb.teacher_tokens()
    )
    (pair,) = mb.pairs
    ids, attention = pad_rows([pair.chosen_ids, pair.rejected_ids])
    response, _ = pad_rows([pair.chosen_mask, pair.rejected_mask])
    rows = mb.pair_rows
    assert torch.equal(rows.input_ids, ids) and torch.equal(rows.attention_mask, attention)
    assert torch.equal(rows.response_mask, response)
    assert torch.equal(rows.head_rows, (response[:, 1:] != 0).reshape(-1).nonzero().squeeze(-1))
    assert rows.tokens == [pair.chosen_ids, pair.rejected_ids]


@pytest.mark.parametrize("path", ["plain", "packed", "tree"])
def test_hidden_states_planned_from_host_tokens_equal_the_read_ones(tiny, path, monkeypatch):
    prompt = list(range(10, 30))  # a shared 20-token prompt
    rows = [[*prompt, 40, 41, 42], [*prompt, 50], list(range(60, 67)), [*prompt, 70, 71]]
    ids, attention = pad_rows(rows)
    # the paths a device that does not pack takes (packing has its own equivalence tests)
    monkeypatch.setattr("composer_replication.model.packed_attention.PACKING_DEVICES", ())
    if path == "tree":  # the packed forward gives way to a forward per shared segment
        monkeypatch.setattr("composer_replication.model.shared_prefix.PACKED_MAX_TOKENS", 0)
    share = path != "plain"
    want = last_hidden_states(tiny[0], ids, attention, share_prefixes=share)
    with HostReads() as reads:
        got = last_hidden_states(tiny[0], ids, attention, share_prefixes=share, row_tokens=rows)
    if path != "tree":  # (the per-segment forwards still hand the model 2-D masks)
        assert reads.total == 0, dict(reads.counts)
    real = attention.bool()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=0)


def test_micro_batch_moves_to_its_own_device_as_itself():
    (mb,) = _micro_batches(1)
    assert mb.to("cpu") is mb
    assert mb.to(torch.device("cpu")) is mb


def test_adamw_runs_fused_where_torch_has_the_kernel():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert adamw_kernel(params) == {"fused": True}
    assert adamw_kernel([torch.nn.Parameter(torch.zeros(2, device="meta"))]) == {"foreach": True}


def test_a_forward_under_autocast_sees_the_weights_of_the_last_step(tiny):
    """The run loop sits in one autocast region, and autocast keeps its bfloat16 copy of a
    trainable weight for as long as the region lasts: after each update the learner drops
    the copies, so the next forward computes with the new weights (as a fresh region
    would), not with the first step's."""
    config = RunConfig(optim={"lr": 1e-2})
    learner = Learner(
        copy.deepcopy(tiny[0]),
        model=config.model,
        optim=config.optim,
        loss=config.loss,
        steps=config.steps,
    )
    probe = torch.tensor([[5, 6, 7, 8, 9]])

    def logits() -> torch.Tensor:
        with torch.no_grad():
            return learner.policy(input_ids=probe).logits.float()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        seen = [logits()]
        for step in (1, 2):
            learner.update(_micro_batches(1), step)
            seen.append(logits())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fresh = logits()
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])
    assert torch.equal(seen[2], fresh)
