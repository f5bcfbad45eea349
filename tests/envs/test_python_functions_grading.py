"""``PythonFunctionsEnv.grade_groups``: answers whose graded code is the same run once in the
real sandbox and share the verdict; different code still gets its own run."""

from __future__ import annotations

import pytest

from composer_replication.envs.python_functions import PythonFunctionsEnv
from composer_replication.rollout.types import Rollout

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
