"""datagen on repositories as they are: a unittest suite in tests.py, dependencies installed in
the repository's own virtualenv (offline, from a wheelhouse), the solvability gate's budgets,
and a report of every candidate. Real sandbox, real test runs."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from composer_replication.datagen.feature_deletion import AgentBudgets, generate_tasks
from composer_replication.envs.fd_tasks import read_jsonl_records
from composer_replication.envs.feature_deletion import FeatureDeletionEnv
from composer_replication.rollout.agent import ScriptedSampler
from composer_replication.rollout.tool_calls import format_tool_call
from composer_replication.samples.generation import SamplingSettings
from composer_replication.sandbox.local import LocalSubprocessSandbox
from composer_replication.testing.wheels import pure_wheel, runner_wheels

pytestmark = pytest.mark.integration

CALC = '''\
def add(a, b):
    """Sum of a and b."""
    return a + b


def scale(values, k):
    """Each value times k."""
    return [v * k for v in values]


def unused(x):
    """Nothing tests this."""
    return -x
'''
UNITTEST_SUITE = """\
import unittest

from calc import add, scale


class CalcTests(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)

    def test_scale(self):
        self.assertEqual(scale([1, 2], 3), [3, 6])

    def helper_not_a_candidate(self):
        return add(0, 0)


if __name__ == "__main__":
    unittest.main()
"""


def factory(path: Path, **options) -> LocalSubprocessSandbox:
    return LocalSubprocessSandbox(path, exec_timeout_s=60, **options)


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


def test_a_unittest_suite_in_tests_py_makes_tasks_and_stays_protected(shared_dir: Path, tokenizer):
    repo = write(shared_dir / "calc_repo", {"calc.py": CALC, "tests.py": UNITTEST_SUITE})
    out = shared_dir / "out" / "tasks.jsonl"
    report = generate_tasks(
        repo,
        out,
        max_tasks=5,
        sandbox_factory=factory,
        split=None,
        tokenizer=tokenizer,
        environment="system",
    )
    assert report.test_command == "python -m pytest -q tests.py"
    assert report.test_source == "unittest modules matching test*.py: tests.py"
    assert report.python is None  # no declared dependencies: the sandbox's interpreter
    tasks = {t["qualname"]: t for t in read_jsonl_records(out)}
    assert sorted(tasks) == ["add", "scale"]  # tests.py's functions are never candidates
    assert tasks["add"]["target_tests"] == ["tests.py::CalcTests::test_add"]
    assert tasks["add"]["test_files"] == ["tests.py"]
    cost = tasks["add"]["reference_cost"]
    assert cost["turns"] == 4 and cost["tool_format"] == "text"
    rows = {r["qualname"]: r for r in read_jsonl_records(report.candidates_output)}
    assert rows["unused"] == {
        "file": "calc.py", "qualname": "unused", "outcome": "not_covered",
        "gate": None, "reason": "no test runs the code it changes",
        "kind": "feature_deletion", "change": "body of unused (lines 13-13)",
    }  # fmt: skip
    assert rows["add"]["outcome"] == "accepted" and rows["add"]["n_targets"] == 1
    # an attempt that edits tests.py is caught: the discovered test module is protected
    env = FeatureDeletionEnv(out, tools=("read_file", "replace", "finish"))
    task_id = tasks["add"]["task_id"]
    cheat = [
        format_tool_call(
            "replace",
            {"path": "tests.py", "old": "self.assertEqual(add(2, 3), 5)", "new": "pass"},
        ),
        format_tool_call("finish"),
    ]
    (group,) = env.rollouts(
        None,
        tokenizer,
        [task_id],
        group_size=1,
        sampling=SamplingSettings(max_new_tokens=128),
        sample_fn=ScriptedSampler(tokenizer, [cheat]),
    )
    assert group[0].metadata["hack"] == {"flagged": True, "reasons": ["test_modified: tests.py"]}
    assert group[0].reward == 0.0


def test_dependencies_come_from_the_repositorys_own_virtualenv(shared_dir: Path, tokenizer):
    house = shared_dir / "wheels"
    house.mkdir()
    pure_wheel(house, "tinydep", "1.0", "FACTOR = 7\n")
    runner_wheels(house)
    repo = write(
        shared_dir / "deps_repo",
        {
            "pyproject.toml": '[project]\nname = "depsrepo"\nversion = "0.1"\n'
            'dependencies = ["tinydep"]\n',
            "depsrepo.py": 'import tinydep\n\n\ndef times(x):\n    """x times the factor."""\n'
            "    return x * tinydep.FACTOR\n",
            "tests/test_depsrepo.py": "from depsrepo import times\n\n\ndef test_times():\n"
            "    assert times(2) == 14\n",
        },
    )
    # without its dependency the suite cannot run: every candidate is rejected, with why
    plain = generate_tasks(
        repo, shared_dir / "plain" / "tasks.jsonl", max_tasks=1, sandbox_factory=factory,
        split=None, tokenizer=tokenizer, environment="system",
    )  # fmt: skip
    assert plain.accepted == 0 and plain.rejected["gate1_original_green"] == 1
    assert "tinydep" in plain.rejections[0][2]
    out = shared_dir / "out" / "tasks.jsonl"
    report = generate_tasks(
        repo, out, max_tasks=1, sandbox_factory=factory, split=None, tokenizer=tokenizer,
        wheelhouse=house,
    )  # fmt: skip
    assert report.accepted == 1
    assert report.python is not None and report.python.startswith(str(out.with_name("tasks.envs")))
    (task,) = read_jsonl_records(out)
    assert task["python"] == report.python
    # the environment runs the task with that interpreter: the reference solves it
    env = FeatureDeletionEnv(out, sandbox_factory=factory)
    assert env.solve_with_reference(tokenizer, task["task_id"]).reward == 1.0


def test_tasks_beyond_the_agents_budgets_are_rejected_with_the_reason(shared_dir: Path, tokenizer):
    repo = write(shared_dir / "calc_repo", {"calc.py": CALC, "tests.py": UNITTEST_SUITE})
    out = shared_dir / "out" / "tasks.jsonl"
    report = generate_tasks(
        repo, out, max_tasks=5, sandbox_factory=factory, split=None, tokenizer=tokenizer,
        budgets=AgentBudgets(max_new_tokens=24), only=["add"], environment="system",
    )  # fmt: skip
    assert report.accepted == 0 and report.rejected["gate5_solvable_within_budgets"] == 1
    ((qualname, gate, reason),) = report.rejections
    assert (qualname, gate) == ("add", "gate5_solvable_within_budgets")
    assert reason.startswith("the reference's ") and reason.endswith(
        "the turn budget (sampling.max_new_tokens) is 24"
    )
    assert not out.exists()  # nothing accepted: no task file
    (row,) = read_jsonl_records(report.candidates_output)
    assert (row["outcome"], row["gate"], row["reason"]) == ("rejected", gate, reason)
