"""Sampling ahead of training: the queue's order, version stamps, failures and pending tasks,
and the staleness filter."""

from __future__ import annotations

import threading

import pytest

from composer_replication.config.inference import inference_config
from composer_replication.samples.rollouts import Rollout, mark_frozen_source
from composer_replication.training.rollout_queue import RolloutQueue, drop_stale


def _rollout(task_id: str, version: int | None = None, *, frozen: bool = False) -> Rollout:
    meta = {} if version is None else {"policy_version": version}
    rollout = Rollout(
        task_id=task_id,
        prompt_ids=[1],
        completion_ids=[2],
        inference_logprobs=[-0.5],
        reward=0.0,
        metadata=meta,
    )
    if frozen:
        mark_frozen_source(rollout)
    return rollout


def _sample(tasks, index=0):
    return [[[_rollout(t), _rollout(t)] for t in env_tasks] for env_tasks in tasks]


def test_batches_come_back_in_order_stamped_with_the_version_at_submission():
    version = [3]
    queue = RolloutQueue(_sample, lambda: version[0], depth=2)
    queue.submit([["a", "b"]], 0)
    version[0] = 4
    queue.submit([["c"]], 0)
    pending = queue.pending_batches()  # waits for both, keeps them queued
    assert [tasks for tasks, _ in pending] == [[["a", "b"]], [["c"]]]
    assert [len(groups[0]) for _, groups in pending] == [2, 1]
    tasks, groups, submitted, waited = queue.pop()
    assert tasks == [["a", "b"]] and waited >= 0 and submitted > 0
    assert [[r.metadata["policy_version"] for r in g] for g in groups[0]] == [[3, 3], [3, 3]]
    tasks, groups, _, _ = queue.pop()
    assert tasks == [["c"]] and groups[0][0][0].metadata["policy_version"] == 4
    assert len(queue) == 0
    queue.close()


def test_sampling_runs_in_the_background_until_wait_idle():
    release, started = threading.Event(), threading.Event()

    def slow(tasks, index):
        started.set()
        release.wait(timeout=30)
        return _sample(tasks)

    queue = RolloutQueue(slow, lambda: 0, depth=1)
    queue.submit([["a"]], 0)
    assert started.wait(timeout=30)  # sampling began while this thread goes on
    assert not queue._batches[0].future.done()
    release.set()
    queue.wait_idle()
    assert queue._batches[0].future.done()
    queue.close()


def test_a_failure_while_sampling_is_raised_at_pop():
    def broken(tasks, index):
        raise RuntimeError("engine went away")

    queue = RolloutQueue(broken, lambda: 0, depth=1)
    queue.submit([["a"]], 0)
    queue.wait_idle()  # does not raise: the step that needs the batch does
    with pytest.raises(RuntimeError, match="engine went away"):
        queue.pop()
    queue.close()


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="depth=0"):
        RolloutQueue(_sample, lambda: 0, depth=0)


def test_drop_stale_keeps_recent_groups_and_counts_the_rest():
    tasks = [["a", "b", "c"], ["d"]]
    groups = [
        [
            [_rollout("a", 5), _rollout("a", 5)],
            [_rollout("b", 2)],
            [_rollout("c", 4), _rollout("c", 3)],
        ],
        [[_rollout("d", 6)]],
    ]
    kept_tasks, kept, metrics = drop_stale(tasks, groups, trainer_version=6, max_off_policy_steps=2)
    # b is 4 versions old, c's oldest rollout 3: both dropped (3 rollouts)
    assert kept_tasks == [["a"], ["d"]]
    assert [[r.task_id for g in env for r in g] for env in kept] == [["a", "a"], ["d"]]
    assert metrics["rollouts/stale_dropped"] == 3.0
    assert metrics["async/staleness_mean"] == pytest.approx((1 + 1 + 0) / 3)
    assert metrics["async/staleness_max"] == 1.0


def test_the_queue_stamps_the_live_policys_rollouts_only():
    def mixed(tasks, index):  # environment 0 samples the policy, environment 1 is frozen
        live, frozen = tasks
        return [[[_rollout(t)] for t in live], [[_rollout(t, frozen=True)] for t in frozen]]

    queue = RolloutQueue(mixed, lambda: 7, depth=1)
    queue.submit([["a"], ["b"]], 0)
    _, ((live,), (frozen,)), _, _ = queue.pop()
    assert live[0].policy_version == 7
    assert frozen[0].from_frozen_source and frozen[0].policy_version is None
    assert "policy_version" not in frozen[0].metadata
    queue.close()


def test_drop_stale_never_drops_a_frozen_sources_rollouts():
    """Staleness is the sampling policy's drift from the trained one: a frozen source does
    not drift. Its rollouts are kept however old the batch, counted apart, and left out of
    the staleness statistics; the live policy's groups of the same batch are dropped."""
    tasks = [["a", "b"], ["c", "d"]]
    groups = [
        [[_rollout("a", 1), _rollout("a", 1)], [_rollout("b", 4)]],  # the live policy
        [[_rollout("c", frozen=True), _rollout("c", frozen=True)], [_rollout("d", frozen=True)]],
    ]
    kept_tasks, kept, metrics = drop_stale(tasks, groups, trainer_version=5, max_off_policy_steps=1)
    assert kept_tasks == [["b"], ["c", "d"]]
    assert [[len(g) for g in env] for env in kept] == [[1], [2, 1]]
    assert metrics["rollouts/stale_dropped"] == 2.0  # group a, 4 versions old
    assert metrics["rollouts/frozen_source"] == 3.0
    assert metrics["async/staleness_mean"] == 1.0 and metrics["async/staleness_max"] == 1.0
    # a marked rollout that still had a version (marked after stamping) is frozen all the same
    late = _rollout("e", 0)
    mark_frozen_source(late)
    assert late.policy_version is None
    assert drop_stale([["e"]], [[[late]]], trainer_version=9, max_off_policy_steps=0)[0] == [["e"]]


def test_drop_stale_on_policy_rollouts_are_kept():
    tasks, groups = [["a"]], [[[_rollout("a")]]]  # no version: sampled by the current policy
    assert drop_stale(tasks, groups, trainer_version=3, max_off_policy_steps=0)[0] == tasks


def test_async_config_is_checked():
    with pytest.raises(ValueError, match="raise max_off_policy_steps"):
        inference_config(engine="vllm", async_level=3, max_off_policy_steps=2)
    with pytest.raises(ValueError, match="async_level"):
        inference_config(async_level="sometimes")
    assert inference_config(engine="vllm", async_level=1).max_off_policy_steps == 8
    assert inference_config(async_level=1).resolved_async_level("cpu") == 1  # in process too


def test_auto_async_level_samples_ahead_on_a_gpu_only():
    auto = inference_config()
    assert auto.async_level == "auto"
    assert auto.resolved_async_level("cuda") == 1
    assert auto.resolved_async_level("cpu") == 0
    assert auto.resolved_async_level("cuda", distributed=True) == 0  # in-process ranks
    assert inference_config(engine="vllm").resolved_async_level("cuda", distributed=True) == 1
    assert inference_config(max_off_policy_steps=0).resolved_async_level("cuda") == 0
    assert inference_config(async_level=0).resolved_async_level("cuda") == 0
    with pytest.raises(ValueError, match="under torchrun set async_level = 0"):
        inference_config(async_level=1).resolved_async_level("cuda", distributed=True)


def test_a_job_sees_the_submitting_threads_context():
    import contextvars

    marker: contextvars.ContextVar[str] = contextvars.ContextVar("marker", default="unset")
    seen = []

    def sample(tasks, index):
        seen.append(marker.get())
        return _sample(tasks)

    queue = RolloutQueue(sample, lambda: 0, depth=1)
    token = marker.set("the trainer's")
    queue.submit([["a"]], 0)
    marker.reset(token)
    queue.pop()
    queue.close()
    assert seen == ["the trainer's"]


def test_a_sampled_batch_is_queued_as_it_was():
    queue = RolloutQueue(_sample, lambda: 9, depth=1)
    groups = [[[_rollout("a", 2)]]]
    queue.put_sampled([["a"]], groups)
    tasks, popped, _, _ = queue.pop()
    assert tasks == [["a"]] and popped is groups and popped[0][0][0].policy_version == 2
    queue.close()
