"""Bug-fix tasks: the problem statement is written from the failing tests (their names, what
they reported, the innermost frame in the repository's code), never from the patch; and
(integration) datagen --kind bugs on the fixture repository, through every gate, with the
reference agent's episode that runs the tests first."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from composer_replication.datagen.bug_tasks import (
    bug_prompt,
    failing_code,
    innermost_frame,
    problem_statement,
)
from composer_replication.datagen.generation import generate_tasks
from composer_replication.envs.fd_tasks import FDTask, TaskReference, read_jsonl_records
from composer_replication.safety.holdout import HeldoutSplit, split_group
from composer_replication.sandbox.local import LocalSubprocessSandbox

FD_REPO = Path(__file__).resolve().parents[1] / "fixtures" / "fd_repo"

# what pytest writes into a junit report for a failure deep in the code (--tb=auto: the
# first and last entries long, the middle short)
DEEP = """\
def test_g():
>       assert g(0) == 1
               ^^^^

tests/test_x.py:5:
_ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _
pkg/mod.py:7: in g
    return h(y)
           ^^^^
_ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _

x = 1

    def h(x):
>       return [1][x]
               ^^^^^^
E       IndexError: list index out of range

pkg/mod.py:2: IndexError"""

SHALLOW = """\
def test_add():
>       assert add(2, 2) == 4
E       assert 0 == 4
E        +  where 0 = add(2, 2)

tests/test_x.py:9: AssertionError"""

THROUGH_A_LIBRARY = """\
def test_j():
>       j({})

tests/test_j.py:3:
_ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _
src/pkg/enc.py:11: in j
    return json.dumps(value, default=self.hook)
/usr/lib/python3.11/json/__init__.py:238: in dumps
    **kw).encode(obj)
_ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _

>   raise TypeError(o)
E   TypeError: {}

/usr/lib/python3.11/json/encoder.py:180: TypeError"""


def test_the_innermost_frame_in_the_repositorys_code() -> None:
    deep = innermost_frame(DEEP)
    assert (deep.path, deep.line, deep.function, deep.code) == (
        "pkg/mod.py",
        2,
        "h",
        "return [1][x]",
    )
    assert innermost_frame(SHALLOW) is None  # the failure never left the test
    library = innermost_frame(THROUGH_A_LIBRARY)  # the standard library is not the repository
    assert (library.path, library.line, library.function, library.code) == (
        "src/pkg/enc.py",
        11,
        "j",
        "return json.dumps(value, default=self.hook)",
    )


def test_the_problem_statement_is_the_failing_tests_report() -> None:
    targets = ["tests/test_x.py::test_g", "tests/test_x.py::test_add", "tests/test_y.py::test_z"]
    failures = {targets[0]: DEEP, targets[1]: SHALLOW}
    text = problem_statement(targets, failures)
    assert text.startswith("Tests of this repository fail: the code has a bug.")
    assert "tests/test_x.py::test_g fails:\n    assert g(0) == 1\n" in text
    assert "    E   IndexError: list index out of range\n" in text
    assert "  raised in pkg/mod.py:2, in h: return [1][x]" in text
    assert "tests/test_x.py::test_add fails:\n    assert add(2, 2) == 4\n" in text
    assert "    E   assert 0 == 4\n    E   +  where 0 = add(2, 2)" in text
    assert text.rstrip().endswith("Also failing: tests/test_y.py::test_z.")
    assert "Do not modify tests" in text


def test_the_statement_shows_the_function_the_failures_point_at(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "tests").mkdir()
    mod = "def h(x):\n    return [1][x]\n\n\ndef g(y):\n    return h(y)\n\n\ndef add(a, b):\n    return a - b\n"
    (tmp_path / "pkg" / "mod.py").write_text(mod)
    (tmp_path / "tests" / "test_x.py").write_text("def add(a, b):\n    return 0\n")  # a test's own
    targets = ["tests/test_x.py::test_g", "tests/test_x.py::test_add"]
    # an error raised in the repository: the function of its innermost frame
    raised = failing_code(tmp_path, targets, {targets[0]: DEEP, targets[1]: SHALLOW})
    assert raised is not None and raised.raised
    assert (raised.path, raised.qualname, raised.first_line, raised.last_line) == (
        "pkg/mod.py",
        "h",
        1,
        2,
    )
    assert raised.source == "def h(x):\n    return [1][x]"
    # a wrong value: the repository function the failing line calls (tests are not code)
    called = failing_code(tmp_path, targets, {targets[1]: SHALLOW})
    assert called is not None and not called.raised
    assert (called.qualname, called.first_line) == ("add", 9)
    prompt = bug_prompt(tmp_path, None, targets, {targets[1]: SHALLOW})  # type: ignore[arg-type]
    assert prompt.startswith(problem_statement(targets, {targets[1]: SHALLOW}))
    assert prompt.endswith(
        "The failing tests call `add` (pkg/mod.py, lines 9-10):\n\n"
        "```python\ndef add(a, b):\n    return a - b\n```\n"
    )
    # a name defined twice in the code, or a failure naming no function: the report alone
    (tmp_path / "pkg" / "other.py").write_text("def add(a, b):\n    return a + b\n")
    assert failing_code(tmp_path, targets, {targets[1]: SHALLOW}) is None
    assert failing_code(tmp_path, targets, {targets[1]: "E   assert False"}) is None


def test_a_bug_and_the_deletion_of_its_function_are_split_together() -> None:
    deletion = "fd:repo:pkg/mod.py:parse"
    bug = f"{deletion}#bug:flip_operator-0123456789"
    assert split_group(bug) == deletion and split_group(deletion) == deletion
    split = HeldoutSplit(0.5, salt="any")
    for k in range(40):
        task = f"fd:repo:pkg/mod.py:f{k}"
        assert split.is_heldout(f"{task}#bug:x") == split.is_heldout(task)


def _factory(path: Path) -> LocalSubprocessSandbox:
    return LocalSubprocessSandbox(path, exec_timeout_s=60)


@pytest.mark.integration
@pytest.mark.slow
def test_bug_tasks_from_a_repository_pass_every_gate(shared_dir: Path) -> None:
    repo = shared_dir / "fd_repo"
    shutil.copytree(FD_REPO, repo, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    out = shared_dir / "out" / "bugs.jsonl"
    report = generate_tasks(
        repo,
        out,
        max_tasks=4,
        sandbox_factory=_factory,
        kind="bugs",
        split=None,
        environment="system",
        budgets=None,
    )
    assert report.kind == "bugs" and report.accepted == 4, report.rejections
    rows = read_jsonl_records(report.candidates_output)
    tried = [r for r in rows if r["outcome"] != "not_tried"]
    assert all(r["kind"] == "bug" and r["change"] for r in tried)
    refs = {
        r["task_id"]: TaskReference.from_json(r)
        for r in read_jsonl_records(report.reference_output)
    }
    for task in (FDTask.from_json(r) for r in read_jsonl_records(out)):
        assert task.kind == "bug" and task.bug_kind
        assert task.task_id.startswith(f"fd:fd_repo:{task.file}:{task.qualname}#bug:")
        assert task.target_tests and set(task.target_tests) <= set(task.passing_tests)
        assert task.reference_cost["turns"] == 4  # read, replace, run the tests, finish
        ref = refs[task.task_id]
        # the statement names failing tests and never shows the answer
        assert task.prompt.startswith("Tests of this repository fail")
        assert any(t in task.prompt for t in task.target_tests)
        changed = [line.strip() for line in ref.body.splitlines() if line.strip()]
        buggy = {line.strip() for line in ref.stub.splitlines()}
        assert not [line for line in changed if line not in buggy and line in task.prompt]
        # the workdir holds the bug; the reference puts the function back as it was
        original = (FD_REPO / task.file).read_text(encoding="utf-8")
        assert (Path(task.workdir) / task.file).read_text(encoding="utf-8") != original
        assert ref.solved_files(task.workdir) == {task.file: original}
    assert json.loads(out.read_text().splitlines()[0])["FAIL_TO_PASS"]


@pytest.mark.integration
@pytest.mark.slow
def test_bug_tasks_for_an_agent_that_rewrites_functions_show_the_code(shared_dir: Path) -> None:
    from composer_replication.datagen.generation import AgentBudgets

    repo = shared_dir / "fd_repo"
    shutil.copytree(FD_REPO, repo, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    tools = ("replace_function", "run_tests", "finish")
    report = generate_tasks(
        repo,
        shared_dir / "out" / "bugs.jsonl",
        max_tasks=2,
        sandbox_factory=_factory,
        kind="bugs",
        split=None,
        environment="system",
        budgets=AgentBudgets(max_turns=3, tools=tools),
    )
    assert report.accepted == 2, report.rejections
    for task in (FDTask.from_json(r) for r in read_jsonl_records(report.output)):
        # gate 5 played the episode this agent can: rewrite the function, run, finish
        assert task.reference_cost["turns"] == 3 and task.reference_cost["tools"] == list(tools)
        shown = task.prompt.split("```python\n", 1)[1].split("\n```", 1)[0]
        assert shown in (Path(task.workdir) / task.file).read_text(encoding="utf-8")
    # a statement without code, for an agent that cannot read any: refused at gate 5
    from composer_replication.datagen.generation import ReferenceSolver
    from composer_replication.envs.fd_tasks import read_jsonl_records as records

    ref = next(
        TaskReference.from_json(r)
        for r in records(report.reference_output)
        if r["task_id"] == task.task_id
    )
    blind = dataclasses.replace(task, prompt="Tests fail: fix the bug.")
    scratch = shared_dir / "scratch"
    outcome = ReferenceSolver(_factory, AgentBudgets(max_turns=3, tools=tools), None, scratch)
    refused = outcome.check(blind, ref, scratch / "gone")
    assert not refused.passed
    assert refused.reason == (
        f"the task does not show `{task.qualname}` ({task.file}), which its fix changes, and "
        "the tools read none; offer read_file"
    )
