"""Sampling ahead in process (``[inference] async_level = 1``, the in-process engine): the
next step samples while this one trains (proven with events), from a snapshot of the weights
one version old, the lag is accounted, a resumed run trains on the very batch that was in
flight at its checkpoint, Ctrl-C leaves only complete files, and ``async_level = 0`` is the
sequential step it always was."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
import torch

from composer_replication.inference.snapshot import PolicySnapshot
from composer_replication.training.loop import Trainer, train

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from scripted_env import ScriptedEnv  # noqa: E402
from test_loop import VOLATILE, _config  # noqa: E402

AHEAD = "[inference]\nasync_level = 1\nmax_off_policy_steps = 1"


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def test_the_next_step_samples_while_this_one_trains(tmp_path, tiny_dir):
    """Step n's update waits until batch n+1's sampling has begun, and batch n+1's sampling
    waits until step n's update has begun: with the steps in sequence either wait would
    time out; both are met only when they run at the same time."""
    trainer = Trainer(
        _config(tmp_path, tiny_dir, steps=3, extra=AHEAD),
        environments={"scripted": ScriptedEnv(rising=False)},
    )
    env = trainer.runtimes[0].env
    real_rollouts, real_update = env.rollouts, trainer.learner.update
    sampling_began = [threading.Event() for _ in range(6)]
    update_began = [threading.Event() for _ in range(6)]
    batches: list[tuple[str, object]] = []
    overlaps: list[bool] = []

    def rollouts(sampler, tokenizer, task_ids, *, group_size, sampling):
        if sampling.temperature == 0:  # held-out evaluation: the live policy, here
            return real_rollouts(
                sampler, tokenizer, task_ids, group_size=group_size, sampling=sampling
            )
        k = len(batches)  # training batch k+1 (trained at step k+1)
        batches.append((threading.current_thread().name, sampler))
        sampling_began[k].set()
        if k >= 1:  # batch k+1 samples during step k's update
            overlaps.append(update_began[k - 1].wait(timeout=120))
        return real_rollouts(sampler, tokenizer, task_ids, group_size=group_size, sampling=sampling)

    def update(micro_batches, step):
        update_began[step - 1].set()
        if step < 3:  # the last step has no next batch to wait for
            overlaps.append(sampling_began[step].wait(timeout=120))
        return real_update(micro_batches, step)

    env.rollouts, trainer.learner.update = rollouts, update
    result = trainer.run()
    assert result.steps == 3
    # steps 1-2 waited for batches 2-3 to begin, batches 2-4 for steps 1-3 to begin
    assert overlaps == [True] * 5
    assert len(batches) == 4  # batches 1-3 and batch 4, sampled ahead of a step never run
    assert all(thread.startswith("rollouts") for thread, _ in batches)
    # the snapshot sampled them, never the live policy
    models = {id(sampler.model) for _, sampler in batches}
    assert len(models) == 1 and id(trainer.policy) not in models


def test_the_lag_is_one_version_and_logged(tmp_path, tiny_dir):
    result = train(
        _config(tmp_path, tiny_dir, steps=3, extra=AHEAD),
        environments={"scripted": ScriptedEnv(rising=False)},
    )
    rows = [r for r in result.metrics if r["step"] > 0]
    # batch 1 is sampled before any training; every later one by the weights a step old
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["async/staleness_mean"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["rollouts/stale_dropped"] == 0.0 for r in rows)
    assert all("time/wait_rollouts_s" in r for r in rows)


def test_the_snapshot_is_refreshed_in_place_after_each_step(tiny_dir):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_dir)
    snapshot = PolicySnapshot(policy, version=0)
    before = {n: t.data_ptr() for n, t in snapshot.model.named_parameters()}
    assert all(not p.requires_grad for p in snapshot.model.parameters())
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.5)
    live = dict(policy.named_parameters())
    assert not all(torch.equal(t, live[n]) for n, t in snapshot.model.named_parameters())
    snapshot.refresh(policy, 7)
    assert snapshot.version == 7
    for name, tensor in snapshot.model.named_parameters():
        assert torch.equal(tensor, live[name]) and tensor.data_ptr() == before[name]


def test_async_level_zero_is_the_sequential_step(tmp_path, tiny_dir):
    """``async_level = 0`` (and 'auto' on a CPU) samples in the trainer's thread with the
    live policy: the same metrics as the step always made, no snapshot."""
    seen: list[tuple[str, object]] = []

    class Recording(ScriptedEnv):
        def rollouts(self, sampler, tokenizer, task_ids, **kw):
            seen.append((threading.current_thread().name, getattr(sampler, "model", None)))
            return super().rollouts(sampler, tokenizer, task_ids, **kw)

    zero = _config(tmp_path / "zero", tiny_dir, steps=2, extra="[inference]\nasync_level = 0")
    auto = _config(tmp_path / "auto", tiny_dir, steps=2)
    trainer = Trainer(zero, environments={"scripted": Recording(rising=False)})
    assert trainer.async_level == 0
    a = trainer.run()
    assert trainer.snapshot is None
    assert {thread for thread, _ in seen} == {"MainThread"}
    assert {id(model) for _, model in seen} == {id(trainer.policy)}
    b = train(auto, environments={"scripted": ScriptedEnv(rising=False)})
    assert _strip(a.metrics) == _strip(b.metrics)
    assert all("async/staleness_max" not in r for r in a.metrics)


def test_resume_trains_on_the_batch_sampled_ahead_before_the_checkpoint(tmp_path, tiny_dir):
    """A checkpoint taken with batch n+1 sampled ahead (by the weights before step n) keeps
    that batch: the resumed run trains on it, and ends where an uninterrupted run ends."""

    def config(run_dir, steps):
        cfg = _config(run_dir, tiny_dir, steps=steps, extra=AHEAD)
        # a constant learning rate: the two halves' schedules do not depend on their lengths
        return cfg.model_copy(
            update={"optim": cfg.optim.model_copy(update={"schedule": "constant"})}
        )

    reference = train(
        config(tmp_path / "ref", 4), environments={"scripted": ScriptedEnv(rising=False)}
    )
    cut = tmp_path / "cut"
    first = train(config(cut, 2), environments={"scripted": ScriptedEnv(rising=False)})
    state = torch.load(
        first.run_dir / "checkpoints" / "step_000002" / "state.pt", weights_only=False
    )
    ((tasks, groups),) = state["extra"]["pending_batches"]
    assert tasks and all(r.policy_version == 1 for g in groups[0] for r in g)
    resumed = train(
        config(cut, 4), resume=True, environments={"scripted": ScriptedEnv(rising=False)}
    )
    rows = [json.loads(x) for x in (resumed.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert _strip(rows) == _strip(reference.metrics)
    ref_w, got_w = _final_weights(reference.run_dir), _final_weights(resumed.run_dir)
    assert ref_w.keys() == got_w.keys() and ref_w
    assert all(torch.equal(ref_w[k], got_w[k]) for k in ref_w)


def _final_weights(run_dir):
    from safetensors.torch import load_file

    return load_file(str(next((run_dir / "final_model").glob("*.safetensors"))))


def test_ctrl_c_with_a_batch_in_flight_leaves_only_complete_files(tmp_path, tiny_dir):
    trainer = Trainer(
        _config(tmp_path, tiny_dir, steps=4, extra=AHEAD),
        environments={"scripted": ScriptedEnv(rising=False)},
    )
    real_update = trainer.learner.update

    def update(micro_batches, step):
        if step == 3:
            raise KeyboardInterrupt
        return real_update(micro_batches, step)

    trainer.learner.update = update
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    assert trainer.rollout_queue is None and trainer.snapshot is None
    assert not [t for t in threading.enumerate() if t.name.startswith("rollouts")]
    run = trainer.run_dir
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert checkpoints == ["step_000001", "step_000002"]
    for name in checkpoints:
        torch.load(run / "checkpoints" / name / "state.pt", weights_only=False)  # whole
    assert not list(run.rglob("*.tmp*"))
