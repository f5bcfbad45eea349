"""Importing SWE-style instances: a real git repository with a bug, its gold patch and test
patch as real diffs, every gate in the real sandbox, the tasks loaded, solved and graded by
FeatureDeletionEnv, and the `import-tasks` command."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from typer.testing import CliRunner

from composer_replication.cli import app
from composer_replication.datagen.swe import SWE_GATES, ImportReport, import_instances
from composer_replication.envs.fd_tasks import FDTask, TaskReference, read_jsonl_records
from composer_replication.envs.feature_deletion import FeatureDeletionEnv
from composer_replication.rollout.agent import ScriptedSampler
from composer_replication.safety.holdout import HeldoutSplit
from composer_replication.samples.generation import SamplingSettings
from composer_replication.sandbox.local import LocalSubprocessSandbox
from composer_replication.sandbox.workdir import make_shared_tempdir

pytestmark = pytest.mark.integration

# swe:acme__calc-2 is held out under this split; -1 and -3 are training tasks
SPLIT = HeldoutSplit(0.5, "swe-import-tests-0")
OPS = '''def add(a, b):
    return a + b


def clamp(value, low, high):
    """value, limited to [low, high]."""
    return max(low, value)
'''
FIXED = OPS.replace("return max(low, value)", "return min(high, max(low, value))")
TESTS = """from calc.ops import add, clamp


def test_add():
    assert add(2, 3) == 5


def test_clamp_low():
    assert clamp(-1, 0, 10) == 0
"""
NEW_TEST = """

def test_clamp_high():
    assert clamp(11, 0, 10) == 10
"""
ADD = "tests/test_ops.py::test_add"
LOW = "tests/test_ops.py::test_clamp_low"
HIGH = "tests/test_ops.py::test_clamp_high"
ISSUE = "clamp(11, 0, 10) returns 11; it should never exceed high."
HINT = "look at the max() call in clamp"


class Fixture(NamedTuple):
    root: Path  # holds repos/, calc.tar.gz and the instances file
    base: str
    patch: str
    test_patch: str
    no_fix: str  # a real diff of calc/ops.py that leaves the bug


def _git(repo: Path, *args: str) -> str:
    argv = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    return subprocess.run([*argv, *args], check=True, capture_output=True, text=True).stdout


def _make_repository(root: Path) -> Fixture:
    """repos/acme__calc: the buggy base commit, then the upstream fix (test and code) on top
    (so HEAD is not base_commit); repos/calc: a clone; calc.tar.gz: the base tree."""
    repo = root / "repos" / "acme__calc"
    (repo / "calc").mkdir(parents=True)
    (repo / "tests").mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "calc" / "__init__.py").write_text("")
    (repo / "calc" / "ops.py").write_text(OPS)
    (repo / "tests" / "test_ops.py").write_text(TESTS)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    base = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "calc" / "ops.py").write_text(OPS.replace("a + b", "b + a"))
    no_fix = _git(repo, "diff")
    _git(repo, "checkout", "--", ".")
    (repo / "calc" / "ops.py").write_text(FIXED)
    (repo / "tests" / "test_ops.py").write_text(TESTS + NEW_TEST)
    patch, test_patch = _git(repo, "diff", "--", "calc"), _git(repo, "diff", "--", "tests")
    _git(repo, "commit", "-qam", "fix clamp")
    _git(
        repo, "archive", "--format=tar.gz", "--prefix=calc/", "-o", str(root / "calc.tar.gz"), base
    )
    subprocess.run(["git", "clone", "-q", str(repo), str(root / "repos" / "calc")], check=True)
    return Fixture(root, base, patch, test_patch, no_fix)


def _instance(fx: Fixture, instance_id: str, **fields: Any) -> dict[str, Any]:
    row = {
        "instance_id": instance_id,
        "repo": "acme/calc",
        "base_commit": fx.base,
        "problem_statement": ISSUE,
        "patch": fx.patch,
        "test_patch": fx.test_patch,
        "FAIL_TO_PASS": json.dumps([HIGH]),  # as SWE-bench stores it: a JSON-encoded list
        "PASS_TO_PASS": [ADD, LOW],
        "hints_text": HINT,
        "version": "1.0",
    }
    row.update(fields)
    return {k: v for k, v in row.items() if v is not None}


def _write_instances(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _factory(path: Path, **options: Any) -> LocalSubprocessSandbox:
    return LocalSubprocessSandbox(path, exec_timeout_s=60, **options)


# (line, instance id, gate, a part of the reason) of every instance that must be rejected
REJECTED = [
    (4, "acme__calc-4", "gate2_fail_to_pass_fail", f"already pass before the gold patch ({ADD})"),
    (5, "acme__calc-5", "gate3_pass_to_pass_pass", f"do not pass before the gold patch ({HIGH}"),
    (
        6,
        "acme__calc-6",
        "gate4_gold_patch_passes",
        f"PASS_TO_PASS tests do not pass ({HIGH}: failed)",
    ),
    (7, "acme__calc-7", "gate1_repository", "the test_patch does not apply: "),
    (8, "acme__calc-8", "gate4_gold_patch_passes", "the gold patch does not apply: "),
    (9, "acme__calc-9", "gate1_repository", "repo_path 'nowhere' ("),
    (10, "acme__calc-10", "gate1_repository", f"commit {'0' * 40} does not exist in "),
    (11, None, "gate0_instance", "line 11 is not JSON: "),
    (12, "acme__calc-12", "gate0_instance", "missing required field(s) patch"),
    (13, "acme__calc-1", "gate0_instance", "'acme__calc-1' appears twice (lines 1 and 13)"),
    (14, "acme__calc-14", "gate0_instance", "FAIL_TO_PASS is empty"),
]


@pytest.fixture(scope="module")
def imported(tokenizer) -> Iterator[tuple[ImportReport, Fixture]]:
    root = make_shared_tempdir("cr-swe-test-")  # (shared_dir's kind, for the whole module)
    fx = _make_repository(root)
    no_context = fx.test_patch.replace("clamp(-1, 0, 10)", "clamp(-2, 0, 10)")
    rows = [
        _instance(fx, "acme__calc-1", repo_path="repos/acme__calc"),  # a git repository
        _instance(fx, "acme__calc-2"),  # found in repos= as <owner>__<name>
        _instance(fx, "acme__calc-3", repo_path="calc.tar.gz"),  # an archive of base_commit
        _instance(fx, "acme__calc-4", repo="other/calc", FAIL_TO_PASS=[ADD]),  # repos=/calc
        _instance(fx, "acme__calc-5", PASS_TO_PASS=[ADD, HIGH]),
        _instance(fx, "acme__calc-6", patch=fx.no_fix),
        _instance(fx, "acme__calc-7", test_patch=no_context),
        _instance(
            fx, "acme__calc-8", patch=fx.patch.replace("-    return max(", "-    return min(")
        ),
        _instance(fx, "acme__calc-9", repo_path="nowhere"),
        _instance(fx, "acme__calc-10", base_commit="0" * 40),
        '{"instance_id": "acme__calc-11", ',
        _instance(fx, "acme__calc-12", patch=None),
        _instance(fx, "acme__calc-1", repo_path="repos/acme__calc"),
        _instance(fx, "acme__calc-14", FAIL_TO_PASS="[]"),
    ]
    instances = _write_instances(root / "instances.jsonl", rows)
    report = import_instances(
        instances,
        root / "out" / "tasks.jsonl",
        sandbox_factory=_factory,
        split=SPLIT,
        repos=root / "repos",
        tokenizer=tokenizer,
    )
    yield report, fx
    shutil.rmtree(root, ignore_errors=True)


def _tasks(report: ImportReport) -> dict[str, FDTask]:
    assert report.heldout_output is not None
    rows = read_jsonl_records(report.output) + read_jsonl_records(report.heldout_output)
    return {r["qualname"]: FDTask.from_json(r) for r in rows}


def test_accepted_instances_become_swe_tasks_with_exact_fields(imported) -> None:
    report, _ = imported
    assert (report.instances, report.accepted, report.train, report.heldout) == (14, 3, 2, 1)
    assert report.rejected == {
        "gate0_instance": 4,
        "gate1_repository": 3,
        "gate2_fail_to_pass_fail": 1,
        "gate3_pass_to_pass_pass": 1,
        "gate4_gold_patch_passes": 2,
        "gate5_solvable_within_budgets": 0,
    }
    assert tuple(report.rejected) == SWE_GATES
    tasks = _tasks(report)
    assert sorted(tasks) == ["acme__calc-1", "acme__calc-2", "acme__calc-3"]
    workdirs = Path(report.workdirs)
    for name, task in tasks.items():
        assert task.task_id == f"swe:{name}" and task.kind == "swe"
        assert (task.repo, task.file, task.qualname) == ("acme/calc", "calc/ops.py", name)
        assert task.target_tests == (HIGH,)
        assert task.passing_tests == (ADD, LOW)
        assert task.graded_tests == (HIGH, ADD, LOW)
        assert task.test_command == "python -m pytest -q"
        assert task.test_files == ()  # tests/test_ops.py: protected by the usual names anyway
        assert task.files == ("calc/__init__.py", "calc/ops.py", "tests/test_ops.py")
        assert (task.python, task.python_root, task.image) == (None, None, None)
        assert task.split == ("heldout" if SPLIT.is_heldout(task.task_id) else "train")
        assert Path(task.workdir).parent == workdirs
        assert task.reference_cost is not None and task.reference_cost["turns"] == 4
        assert task.prompt.startswith(f"Resolve this issue in the repository acme/calc.\n\n{ISSUE}")
        assert f"must pass once it is resolved: {HIGH}." in task.prompt
        assert "Do not modify tests or test configuration" in task.prompt
        assert HINT not in task.prompt


def test_the_workdir_holds_the_base_tree_with_the_test_patch_only(imported) -> None:
    report, _ = imported
    for task in _tasks(report).values():
        workdir = Path(task.workdir)
        assert (workdir / "tests" / "test_ops.py").read_text() == TESTS + NEW_TEST
        assert (workdir / "calc" / "ops.py").read_text() == OPS  # base_commit, not HEAD's fix
        on_disk = sorted(p.relative_to(workdir).as_posix() for p in workdir.rglob("*"))
        assert on_disk == ["calc", *task.files[:2], "tests", task.files[2]]  # no .git


def test_the_hidden_reference_holds_the_patched_files(imported) -> None:
    report, _ = imported
    path = Path(report.reference_output)
    assert path.stat().st_mode & 0o777 == 0o600
    refs = [TaskReference.from_json(r) for r in read_jsonl_records(path)]
    assert [r.task_id for r in refs] == [f"swe:acme__calc-{k}" for k in (1, 2, 3)]
    for ref in refs:
        assert ref.files == {"calc/ops.py": FIXED}
        assert (ref.file, ref.start_line, ref.end_line, ref.stub, ref.body) == (
            "calc/ops.py",
            0,
            0,
            "",
            "",
        )


def test_every_bad_instance_is_a_row_with_its_gate_and_reason(imported) -> None:
    report, _ = imported
    rows = read_jsonl_records(report.candidates_output)
    assert [r["line"] for r in rows] == list(range(1, 15))
    for row in rows[:3]:
        assert (row["outcome"], row["gate"], row["reason"]) == ("accepted", None, "")
        assert row["task_id"] == f"swe:{row['instance_id']}" and row["split"] is not None
    for line, instance_id, gate, reason in REJECTED:
        row = rows[line - 1]
        assert (row["instance_id"], row["outcome"], row["gate"]) == (instance_id, "rejected", gate)
        assert reason in row["reason"], row["reason"]
        assert row["split"] is None
    assert "patch does not apply" in rows[6]["reason"]  # git's own message
    assert [r[1:] for r in report.rejections] == [(r["gate"], r["reason"]) for r in rows[3:]]
    assert report.rejections[7][0] == "line 11"


def test_held_out_instances_go_to_the_held_out_file_only(imported) -> None:
    report, _ = imported
    train = [r["task_id"] for r in read_jsonl_records(report.output)]
    held = [r["task_id"] for r in read_jsonl_records(report.heldout_output)]
    assert (train, held) == (["swe:acme__calc-1", "swe:acme__calc-3"], ["swe:acme__calc-2"])
    record = json.loads(Path(report.output).with_name("tasks.split.json").read_text())
    assert HeldoutSplit.from_record(record, "split record") == SPLIT


def test_the_environment_solves_the_task_with_its_reference_and_grades_no_change_zero(
    imported, tokenizer
) -> None:
    report, _ = imported
    env = FeatureDeletionEnv(report.output)
    assert sorted(env.task_ids()) == [f"swe:acme__calc-{k}" for k in (1, 2, 3)]
    solved = env.solve_with_reference(tokenizer, "swe:acme__calc-1")
    assert solved.reward == 1.0 and "reference_problem" not in solved.metadata
    finish = env.format_for(tokenizer).format_call("finish", {})
    ((idle,),) = env.rollouts(
        None,
        tokenizer,
        ["swe:acme__calc-1"],
        group_size=1,
        sampling=SamplingSettings(max_new_tokens=128, temperature=0),
        sample_fn=ScriptedSampler(tokenizer, [[finish]]),
    )
    assert idle.reward == 0.0 and idle.error is None
    assert (idle.metadata["passed_targets"], idle.metadata["n_targets"]) == (0, 1)
    assert idle.metadata["broken_tests"] == []
    assert idle.metadata["tests"] == {"passed": 2, "failed": 1, "errors": 0}  # graded: 3 only


def test_every_kind_of_repository_materialises_the_base_tree(shared_dir: Path) -> None:
    from composer_replication.datagen.repository_checkout import is_git_repository, materialise

    fx = _make_repository(shared_dir)
    repo = shared_dir / "repos" / "acme__calc"
    subprocess.run(["git", "clone", "-q", "--bare", str(repo), str(shared_dir / "bare.git")])
    shutil.make_archive(str(shared_dir / "calc"), "zip", shared_dir / "repos" / "calc")
    plain = shared_dir / "plain"
    # a plain folder (no history) is taken as it is: here at HEAD, the fix
    shutil.copytree(shared_dir / "repos" / "calc", plain, ignore=shutil.ignore_patterns(".git"))
    assert not is_git_repository(repo / "calc")  # inside a repository, not one
    sources = {
        "worktree": (repo, OPS),
        "bare": (shared_dir / "bare.git", OPS),
        "tar.gz": (shared_dir / "calc.tar.gz", OPS),
        "zip": (shared_dir / "calc.zip", FIXED),
        "folder": (plain, FIXED),
    }
    for kind, (source, ops) in sources.items():
        dest = shared_dir / "out" / kind
        materialise(source, fx.base, dest, shared_dir)
        tree = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
        assert tree == ["calc/__init__.py", "calc/ops.py", "tests/test_ops.py"], kind
        assert (dest / "calc" / "ops.py").read_text() == ops, kind
    assert _git(repo, "status", "--porcelain") == ""  # the repository is left as it was


def test_import_refuses_unusable_arguments(shared_dir: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        import_instances(
            shared_dir / "none.jsonl", shared_dir / "t.jsonl", sandbox_factory=_factory
        )
    empty = _write_instances(shared_dir / "empty.jsonl", ["", "  "])
    with pytest.raises(ValueError, match="holds no instances"):
        import_instances(empty, shared_dir / "t.jsonl", sandbox_factory=_factory)
    one = _write_instances(shared_dir / "one.jsonl", ["{}"])
    with pytest.raises(ValueError, match="is a directory"):
        import_instances(one, shared_dir, sandbox_factory=_factory)
    with pytest.raises(ValueError, match="repos"):
        import_instances(one, shared_dir / "t.jsonl", sandbox_factory=_factory, repos=one)
    assert sorted(p.name for p in shared_dir.iterdir()) == ["empty.jsonl", "one.jsonl"]


def test_the_import_tasks_command_prints_the_gate_table_and_exits_0_1_2(shared_dir: Path) -> None:
    fx = _make_repository(shared_dir)
    good = _write_instances(
        shared_dir / "good.jsonl", [_instance(fx, "acme__calc-1"), _instance(fx, "acme__calc-2")]
    )
    out = shared_dir / "out" / "tasks.jsonl"
    runner = CliRunner()
    repos = ["--repos", str(shared_dir / "repos")]
    result = runner.invoke(
        app, ["import-tasks", str(good), "-o", str(out), *repos, "--max-tasks", "1"]
    )
    assert result.exit_code == 0, result.output
    for line in (
        "accepted (train)",
        "rejected: gate1_repository",
        "not tried (--max-tasks reached)",
        "hidden references",
    ):
        assert line in result.output
    rows = read_jsonl_records(out) + read_jsonl_records(out.with_name("tasks.heldout.jsonl"))
    assert [r["task_id"] for r in rows] == ["swe:acme__calc-1"]
    outcomes = read_jsonl_records(out.with_name("tasks.candidates.jsonl"))
    assert [(r["outcome"], r["reason"]) for r in outcomes] == [
        ("accepted", ""),
        ("not_tried", "max_tasks reached"),
    ]

    before = {p.name: p.read_bytes() for p in out.parent.iterdir() if p.is_file()}
    missing = _write_instances(
        shared_dir / "missing.jsonl", [_instance(fx, "acme__calc-1", repo="acme/gone")]
    )
    result = runner.invoke(app, ["import-tasks", str(missing), "-o", str(out)])
    assert result.exit_code == 1, result.output
    assert "rejected: gate1_repository" in result.output
    assert "no task file written" in result.output
    after = {p.name: p.read_bytes() for p in out.parent.iterdir() if p.is_file()}
    report = "tasks.candidates.jsonl"
    assert {k: v for k, v in after.items() if k != report} == {
        k: v for k, v in before.items() if k != report
    }
    (row,) = read_jsonl_records(out.with_name(report))
    assert row["gate"] == "gate1_repository"
    assert "has no repo_path and no repos folder was given (--repos DIR)" in row["reason"]

    for argv in (
        ["import-tasks", str(shared_dir / "none.jsonl"), "-o", str(out)],
        ["import-tasks", str(good), "-o", str(shared_dir)],
        ["import-tasks", str(good), "-o", str(out), "--environment", "conda"],
    ):
        result = runner.invoke(app, argv)
        assert result.exit_code == 2, result.output
        errors = [line for line in result.output.splitlines() if line.startswith("error")]
        assert len(errors) == 1, result.output
