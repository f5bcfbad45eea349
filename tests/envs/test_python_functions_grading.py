"""``PythonFunctionsEnv.grade_groups``: answers whose graded code is the same run once in the
real sandbox and share the verdict; different code still gets its own run."""

from __future__ import annotations

import pytest

from composer_replication.envs.python_functions import PythonFunctionsEnv
from composer_replication.samples.rollouts import Rollout

pytestmark = pytest.mark.integration


def _rollout(task_id: str, text: str) -> Rollout:
    return Rollout(
        task_id=task_id,
        prompt_ids=[1],
        completion_ids=[2],
        inference_logprobs=[0.0],
        reward=0.0,
        metadata={"completion_text": text},
    )


def test_answers_with_the_same_code_are_graded_once():
    from composer_replication.envs.python_functions import default_sandbox_factory

    opened = []

    def counting_factory(workdir):
        opened.append(workdir)
        return default_sandbox_factory(workdir)

    env = PythonFunctionsEnv(sandbox_factory=counting_factory, grading_workers=2)
    task = env.tasks["pf-001-sum-list"]
    right = f"```python\n{task.reference}```\n"
    # the same function, fenced differently and with prose around it: the same graded code
    right_again = f"Here it is:\n```python\n{task.reference}```\nDone."
    wrong = "```python\ndef sum_list(nums):\n    return 0\n```\n"
    no_function = "I cannot do this."
    groups = [
        [_rollout(task.task_id, t) for t in (right, right_again, wrong, right)],
        [_rollout(task.task_id, t) for t in (no_function, wrong)],
    ]
    graded = env.grade_groups(groups)
    rewards = [[r.reward for r in g] for g in graded]
    assert rewards[0][0] == rewards[0][1] == rewards[0][3] == 1.0
    assert rewards[0][2] == rewards[1][1] < 1.0
    assert rewards[1][0] == 0.0 and graded[1][0].error == "format: no function"
    assert graded[0][2].metadata["passed"] == graded[1][1].metadata["passed"]
    assert len(opened) == 2  # one sandbox run for the right code, one for the wrong code
    # the same answers one by one: the same verdicts
    singly = [[env.grade_groups([[r]])[0][0].reward for r in g] for g in groups]
    assert singly == rewards


def test_completions_are_graded_while_the_batch_still_decodes(monkeypatch, caplog):
    """With the static decode loop, a row that ends early is graded while the others still
    decode; a slow grade is logged with its cause; grading_workers=0 means one per core."""
    import collections
    import logging
    import time

    from composer_replication.inference.decoding.generate import (
        DecodeOptions,
        InProcessSampler,
        SamplingSettings,
        seeded_rows,
    )
    from composer_replication.model.loading import tiny_policy

    started, ended = [], []

    class TimedSampler(InProcessSampler):
        """Sampling in process that notes when each call returned."""

        def sample_batch(self, *args, **kwargs):
            out = super().sample_batch(*args, **kwargs)
            ended.append(time.perf_counter())
            return out

    model, tok = tiny_policy(seed=5)
    sampler = TimedSampler(model, decode=DecodeOptions(loop="static", sync_every=2))
    env = PythonFunctionsEnv(grading_workers=0, grading_stall_s=0.05)
    assert env.grading_workers >= 1
    task_ids = env.task_ids()[:3]
    settings = SamplingSettings(max_new_tokens=48, temperature=1.0)
    # frequent tokens end rows early, at many different steps
    with seeded_rows(1):
        probe = env.sample(sampler, tok, task_ids, group_size=4, sampling=settings)
    counts = collections.Counter(t for g in probe for r in g for t in r.completion_ids)
    model.generation_config.eos_token_id = [t for t, _ in counts.most_common(30)]
    ended.clear()
    real_grade = env.grade

    def grade(task, text):
        started.append(time.perf_counter())
        time.sleep(0.06)  # over the stall threshold
        return real_grade(task, text)

    monkeypatch.setattr(env, "grade", grade)
    with caplog.at_level(logging.WARNING), seeded_rows(1):
        groups = env.rollouts(sampler, tok, task_ids, group_size=4, sampling=settings)
    lengths = sorted(len(r.completion_ids) for g in groups for r in g)
    assert lengths[0] < lengths[-1] - 4  # rows ended at different windows
    assert min(started) < ended[0]  # grading began before sampling returned
    assert all(r.metadata["grading_s"] >= 0.06 for g in groups for r in g)
    assert "took" in caplog.text and "over 0.05 s" in caplog.text
