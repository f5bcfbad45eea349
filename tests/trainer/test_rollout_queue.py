"""Sampling ahead of training: the queue's order, version stamps, failures and pending tasks,
and the staleness filter."""

from __future__ import annotations

import threading

import pytest

from composer_replication.config.inference import InferenceConfig
from composer_replication.rollout.types import Rollout
from composer_replication.trainer.rollout_queue import RolloutQueue, drop_stale


def _rollout(task_id: str, version: int | None = None) -> Rollout:
    meta = {} if version is None else {"policy_version": version}
    return Rollout(
        task_id=task_id,
        prompt_ids=[1],
        completion_ids=[2],
        inference_logprobs=[-0.5],
        reward=0.0,
        metadata=meta,
    )


def _sample(tasks, index=0):
    return [[[_rollout(t), _rollout(t)] for t in env_tasks] for env_tasks in tasks]


def test_batches_come_back_in_order_stamped_with_the_version_at_submission():
    version = [3]
    queue = RolloutQueue(_sample, lambda: version[0], depth=2)
    queue.submit([["a", "b"]], 0)
    version[0] = 4
    queue.submit([["c"]], 0)
    assert queue.pending_tasks() == [[["a", "b"]], [["c"]]]
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


def test_drop_stale_on_policy_rollouts_are_kept():
    tasks, groups = [["a"]], [[[_rollout("a")]]]  # no version: sampled by the current policy
    assert drop_stale(tasks, groups, trainer_version=3, max_off_policy_steps=0)[0] == tasks


def test_async_config_is_checked():
    with pytest.raises(ValueError, match="needs an inference engine"):
        InferenceConfig(async_level=1)
    with pytest.raises(ValueError, match="raise max_off_policy_steps"):
        InferenceConfig(engine="vllm", async_level=3, max_off_policy_steps=2)
    assert InferenceConfig(engine="vllm", async_level=1).max_off_policy_steps == 8
