"""Sampling ahead of training: ``[inference] async_level = k`` (one-step and k-step off-policy).

With an inference engine the policy samples in another process, so the next steps' rollouts
can be sampled and graded while the trainer runs the current step. :class:`RolloutQueue`
keeps up to ``k`` steps' batches sampling in one background thread, oldest first. The
trainer takes the oldest batch (waiting if it is not done), assigns and scores it in its own
thread (algorithms may run the live policy), submits the next batch, trains, and before the
weight sync waits until no batch is sampling, so every batch is sampled by one policy
version. In process the sampler is a copy of the policy's weights
(:class:`~composer_replication.inference.snapshot.PolicySnapshot`), refreshed at that point.
A checkpoint holds the sampled batches not yet trained on, so a resumed run trains on the
same rollouts. In steady state a batch trained at step ``n`` was sampled by version ``n - k``;
the rl component's importance ratio uses the sampler's log-probs, which corrects for it.

:func:`drop_stale` removes groups older than ``max_off_policy_steps`` (counted, never
silently), and reports the staleness of what is kept. Staleness is drift between the policy
that sampled and the policy being trained, so it applies to the live policy's rollouts only:
a frozen source's rollouts (``Rollout.from_frozen_source``: a frozen model's samples, the
reference solutions) carry no policy version and are always kept.
"""

from __future__ import annotations

import contextvars
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from composer_replication.samples.rollouts import stamp_policy_version

__all__ = ["RolloutQueue", "drop_stale"]

#: one step's task ids per environment, and the groups sampled for them
Tasks = list[list[str]]
EnvGroups = list[list[list[Any]]]


@dataclass
class _Batch:
    tasks: Tasks
    future: Future
    submitted: float


class RolloutQueue:
    """Up to ``depth`` steps' batches of rollouts, sampled in one background thread.

    ``sample(tasks, index) -> groups`` samples and grades one step's tasks (the trainer's
    ``run_rollouts``; ``index`` is the batch's, which seeds its sampling); ``version()`` is
    the policy version the sampler serves when a batch is submitted, stamped on every
    rollout of the live policy in the batch as ``metadata["policy_version"]`` (the trainer
    syncs weights only while no batch samples, so it is the version that sampled it); a
    frozen source's rollouts get none.
    """

    def __init__(
        self,
        sample: Callable[[Tasks, int], EnvGroups],
        version: Callable[[], int],
        *,
        depth: int,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth={depth}: a queue samples at least one step ahead")
        self._sample = sample
        self._version = version
        self.depth = depth
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts")
        self._batches: deque[_Batch] = deque()

    def __len__(self) -> int:
        return len(self._batches)

    def submit(self, tasks: Tasks, index: int) -> None:
        """Start sampling one step's ``tasks`` (after the batches already queued); ``index``
        is handed to ``sample`` (the trainer's batch index, which seeds the sampling)."""
        version = self._version()

        def job() -> EnvGroups:
            groups = self._sample(tasks, index)
            for env_groups in groups:
                for group in env_groups:
                    stamp_policy_version(group, version)
            return groups

        # the job sees this thread's context (row seeds, kept prompt states)
        future = self._executor.submit(contextvars.copy_context().run, job)
        self._batches.append(_Batch(tasks, future, time.perf_counter()))

    def put_sampled(self, tasks: Tasks, groups: EnvGroups) -> None:
        """Queue a batch sampled before (a resumed run's, from its checkpoint): ``pop``
        returns it as it was, policy versions included."""
        future: Future = Future()
        future.set_result(groups)
        self._batches.append(_Batch(tasks, future, time.perf_counter()))

    def pop(self) -> tuple[Tasks, EnvGroups, float, float]:
        """The oldest batch: its tasks, groups, submission time and the seconds waited for
        it (a failure while sampling is raised here)."""
        batch = self._batches.popleft()
        t0 = time.perf_counter()
        groups = batch.future.result()
        return batch.tasks, groups, batch.submitted, time.perf_counter() - t0

    def wait_idle(self) -> None:
        """Block until no batch is sampling (before the sampler's weights change)."""
        for batch in self._batches:
            batch.future.exception()  # waits; the error itself surfaces at pop()

    def pending_batches(self) -> list[tuple[Tasks, EnvGroups]]:
        """The batches not yet trained on, oldest first, as (tasks, groups): waits until none
        is sampling (for checkpoints: a resumed run trains on these very rollouts)."""
        return [(batch.tasks, batch.future.result()) for batch in self._batches]

    def close(self) -> None:
        """Cancel batches that have not started, wait for the running one."""
        for batch in self._batches:
            batch.future.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._batches.clear()


def drop_stale(
    tasks: Tasks, env_groups: EnvGroups, *, trainer_version: int, max_off_policy_steps: int
) -> tuple[Tasks, EnvGroups, dict[str, float]]:
    """Keep the groups sampled at most ``max_off_policy_steps`` versions before
    ``trainer_version`` (the weights about to be trained); metrics of what was kept and
    dropped: ``rollouts/stale_dropped``, ``async/staleness_mean``, ``async/staleness_max``
    (over the live policy's rollouts) and ``rollouts/frozen_source`` (a frozen source's
    rollouts, never stale: all kept).

    A group's staleness is its oldest live rollout's (``trainer_version - policy_version``);
    a live rollout without a version is the current policy's (staleness 0).
    """
    kept_tasks: Tasks = []
    kept_groups: EnvGroups = []
    dropped, frozen, staleness = 0, 0, []
    for task_ids, groups in zip(tasks, env_groups):
        env_tasks, env_kept = [], []
        for task_id, group in zip(task_ids, groups):
            live = [r for r in group if not r.from_frozen_source]
            frozen += len(group) - len(live)
            versions = [
                trainer_version if r.policy_version is None else r.policy_version for r in live
            ]
            age = trainer_version - min(versions, default=trainer_version)
            if age > max_off_policy_steps:
                dropped += len(group)
                continue
            env_tasks.append(task_id)
            env_kept.append(group)
            staleness += [trainer_version - v for v in versions]
        kept_tasks.append(env_tasks)
        kept_groups.append(env_kept)
    metrics = {
        "rollouts/stale_dropped": float(dropped),
        "rollouts/frozen_source": float(frozen),
        "async/staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
        "async/staleness_max": float(max(staleness, default=0)),
    }
    return kept_tasks, kept_groups, metrics
