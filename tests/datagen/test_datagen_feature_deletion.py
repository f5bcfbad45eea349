"""FeatureDeletion end to end on the fixture repo, and each solvability gate rejecting a bad task.

Every gate runs the fixture's real pytest suite inside `LocalSubprocessSandbox`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from composer_replication.datagen.feature_deletion import GenerationReport, generate_tasks
from composer_replication.datagen.gates import GATES, SolvabilityValidator
from composer_replication.envs.fd_tasks import (
    STUB_EXCEPTION,
    FDTask,
    TaskReference,
    make_task_id,
    read_jsonl_records,
    write_tasks,
)
from composer_replication.safety.holdout import HeldoutLeakError, HeldoutSplit
from composer_replication.sandbox.local import LocalSubprocessSandbox
from composer_replication.sandbox.workdir import make_shared_tempdir

pytestmark = pytest.mark.integration

FD_REPO = Path(__file__).resolve().parents[1] / "fixtures" / "fd_repo"
SPLIT = HeldoutSplit(heldout_fraction=0.5, salt="datagen-fd-tests")
# What actually covers each fixture function (tests that fail once its body is gone).
EXPECTED_TARGETS = {
    "shout": ["tests/test_formatters.py::test_render_shout"],
    "whisper": ["tests/test_formatters.py::test_render_whisper"],
    "mean": [
        "tests/test_stats.py::test_mean",
        "tests/test_stats.py::test_mean_empty_raises",
        "tests/test_stats.py::test_variance",
    ],
    "median": [
        "tests/test_stats.py::test_median[values0-2]",
        "tests/test_stats.py::test_median[values1-2.5]",
    ],
    "variance": ["tests/test_stats.py::test_variance"],
    "is_palindrome": ["tests/test_words.py::test_is_palindrome"],
    "normalize_whitespace": ["tests/test_words.py::test_normalize_whitespace"],
    "WordCounter.most_common": ["tests/test_words.py::test_word_counter_most_common"],
}
FILES = {
    "shout": "textkit/formatters.py",
    "whisper": "textkit/formatters.py",
    "mean": "textkit/stats.py",
    "median": "textkit/stats.py",
    "variance": "textkit/stats.py",
    "is_palindrome": "textkit/words.py",
    "normalize_whitespace": "textkit/words.py",
    "WordCounter.most_common": "textkit/words.py",
}


def _factory(path: Path) -> LocalSubprocessSandbox:
    return LocalSubprocessSandbox(path, exec_timeout_s=60)


def _copy_repo(parent: Path) -> Path:
    dest = parent / "fd_repo"
    shutil.copytree(FD_REPO, dest, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    return dest


def _generate(repo: Path, output: Path, only: list[str], **options: Any) -> GenerationReport:
    """``generate_tasks`` on a copy of the fixture as these tests run it: up to 5 tasks of
    the functions ``only`` names, in the system's environment, graded in the local sandbox."""
    return generate_tasks(
        repo,
        output,
        max_tasks=5,
        sandbox_factory=_factory,
        only=only,
        environment="system",
        **options,
    )


def _pick_subset() -> list[str]:
    """Two trainable and one held-out function under SPLIT, so both files get tasks."""
    ids = {q: make_task_id("fd_repo", FILES[q], q) for q in EXPECTED_TARGETS}
    train = [q for q in EXPECTED_TARGETS if not SPLIT.is_heldout(ids[q])]
    held = [q for q in EXPECTED_TARGETS if SPLIT.is_heldout(ids[q])]
    assert len(train) >= 2 and held, "SPLIT must give both kinds among the fixture functions"
    return [*train[:2], held[0]]


@pytest.fixture(scope="module")
def fd_run() -> Iterator[tuple[GenerationReport, Path, list[str]]]:
    root = make_shared_tempdir("cr-fd-test-")
    repo = _copy_repo(root)
    subset = _pick_subset()
    report = generate_tasks(
        repo,
        root / "out" / "tasks.jsonl",
        max_tasks=10,
        sandbox_factory=_factory,
        split=SPLIT,
        only=subset,
        environment="system",
    )
    yield report, root, subset
    shutil.rmtree(root, ignore_errors=True)


def _tasks(path: str | None) -> list[FDTask]:
    assert path is not None
    return [FDTask.from_json(r) for r in read_jsonl_records(path)]


@pytest.mark.slow
def test_fd_accepts_the_covered_functions_with_exact_targets(fd_run) -> None:
    report, _, subset = fd_run
    assert (report.candidates, report.accepted, report.train, report.heldout) == (3, 3, 2, 1)
    assert report.rejected == dict.fromkeys(("not_referenced", *GATES), 0)
    tasks = _tasks(report.output) + _tasks(report.heldout_output)
    assert sorted(t.qualname for t in tasks) == sorted(subset)
    for task in tasks:
        assert list(task.target_tests) == EXPECTED_TARGETS[task.qualname]
        assert len(task.passing_tests) == 14
        assert task.task_id == make_task_id("fd_repo", task.file, task.qualname)
        assert f"`{task.qualname}`" in task.prompt and task.file in task.prompt
        assert task.test_command == "python -m pytest -q"


@pytest.mark.slow
def test_fd_routes_held_out_tasks_to_their_own_file(fd_run) -> None:
    report, _, _ = fd_run
    train, held = _tasks(report.output), _tasks(report.heldout_output)
    assert [t.split for t in train] == ["train", "train"]
    assert [t.split for t in held] == ["heldout"]
    assert not any(SPLIT.is_heldout(t.task_id) for t in train)
    assert all(SPLIT.is_heldout(t.task_id) for t in held)
    with pytest.raises(HeldoutLeakError):  # the training writer itself refuses them
        write_tasks(Path(report.output).with_name("leak.jsonl"), held, split=SPLIT)


@pytest.mark.slow
def test_fd_workdirs_hold_the_stub_and_never_the_reference(fd_run) -> None:
    report, _, _ = fd_run
    refs = {
        r["task_id"]: TaskReference.from_json(r)
        for r in read_jsonl_records(report.reference_output)
    }
    assert os.stat(report.reference_output).st_mode & 0o777 == 0o600
    for task in _tasks(report.output) + _tasks(report.heldout_output):
        ref = refs[task.task_id]
        workdir = Path(task.workdir)
        assert workdir.parent == Path(report.workdirs)
        listed = sorted(
            (Path(d) / f).relative_to(workdir).as_posix()
            for d, _, fs in os.walk(workdir)
            for f in fs
        )
        assert listed == list(task.files)
        assert not any(
            ".cr-junit" in f or "__pycache__" in f or ".pytest_cache" in f for f in listed
        )
        text = (workdir / task.file).read_text()
        assert ref.stub in text and STUB_EXCEPTION in ref.stub
        body_lines = [line for line in ref.body.splitlines() if line.strip()]
        everything = "".join((workdir / f).read_text() for f in listed)
        assert not any(line in everything for line in body_lines if "return" in line)
        assert workdir.stat().st_uid == os.geteuid()  # handed back from the sandbox uid


@pytest.mark.slow
def test_gate4_rejects_a_corrupted_reference_and_accepts_the_real_one(fd_run) -> None:
    report, _, _ = fd_run
    task = _tasks(report.output)[0]
    ref = next(
        TaskReference.from_json(r)
        for r in read_jsonl_records(report.reference_output)
        if r["task_id"] == task.task_id
    )
    validator = SolvabilityValidator(_factory)
    real = validator.reference_restores(Path(task.workdir), ref, task.passing_tests)
    assert real.passed, real.reason
    indent = ref.stub[: len(ref.stub) - len(ref.stub.lstrip())]
    corrupted = replace(ref, body=f"{indent}return None\n")
    outcome = validator.reference_restores(Path(task.workdir), corrupted, task.passing_tests)
    assert (outcome.gate, outcome.passed) == ("gate4_reference_restores", False)
    assert "tests failing" in outcome.reason
    misplaced = replace(ref, start_line=1, end_line=1)
    outcome = validator.reference_restores(Path(task.workdir), misplaced, task.passing_tests)
    assert not outcome.passed and "does not apply" in outcome.reason
    assert STUB_EXCEPTION in (Path(task.workdir) / task.file).read_text()  # task left intact


FLAKY_TEST = """

def test_flaky_on_purpose():
    import os
    seen = os.path.exists("flaky.marker")
    open("flaky.marker", "w").close()
    assert not seen  # passes on the first run only
"""


def test_failing_and_flaky_tests_are_excluded_from_grading_not_fatal(shared_dir: Path) -> None:
    repo = _copy_repo(shared_dir)
    with open(repo / "tests" / "test_stats.py", "a") as fh:
        fh.write("\n\ndef test_broken_on_purpose():\n    assert 0 == 1\n" + FLAKY_TEST)
    report = _generate(repo, shared_dir / "tasks.jsonl", ["mean"], split=None)
    assert report.accepted == 1
    assert report.excluded == {"failed": 1, "flaky": 1}
    assert report.baseline_passing == 14
    (task,) = _tasks(report.output)
    assert task.target_tests == tuple(EXPECTED_TARGETS["mean"])
    graded = set(task.passing_tests)
    assert len(graded) == 14
    assert (
        not {
            "tests/test_stats.py::test_broken_on_purpose",
            "tests/test_stats.py::test_flaky_on_purpose",
        }
        & graded
    )
    # the task file carries SWE-bench's lists too
    (row,) = read_jsonl_records(report.output)
    assert row["FAIL_TO_PASS"] == list(task.target_tests)
    assert row["PASS_TO_PASS"] == [t for t in task.passing_tests if t not in task.target_tests]


def test_gate1_rejects_a_repo_where_no_test_passes(shared_dir: Path) -> None:
    repo = _copy_repo(shared_dir)
    with open(repo / "textkit" / "__init__.py", "a") as fh:
        fh.write("\nraise RuntimeError('broken_on_purpose')\n")
    report = _generate(repo, shared_dir / "tasks.jsonl", ["mean"])
    assert report.accepted == 0
    assert report.rejected["gate1_original_green"] == 1
    reason = report.rejections[0][2]
    assert "no test of the original suite passes" in reason and "broken_on_purpose" in reason
    assert not (shared_dir / "tasks.jsonl").exists()  # nothing accepted: nothing written


def test_gate2_rejects_deleting_an_uncovered_function(shared_dir: Path) -> None:
    repo = _copy_repo(shared_dir)
    report = _generate(repo, shared_dir / "tasks.jsonl", ["reverse_words"], static_preselect=False)
    assert report.rejected["gate2_targets_red"] == 1
    assert report.rejections == (
        (
            "reverse_words",
            "gate2_targets_red",
            "no test fails with the change (the code is not covered)",
        ),
    )


def test_preselection_skips_what_no_test_runs_without_a_gate_run(shared_dir: Path) -> None:
    repo = _copy_repo(shared_dir)
    report = _generate(repo, shared_dir / "t.jsonl", ["reverse_words", "mean"], split=None)
    # the suite's coverage (one traced run) shows no test runs reverse_words
    assert report.uncovered == 1 and report.candidates == 1 and report.accepted == 1
    assert sum(report.rejected.values()) == 0


def test_without_coverage_the_names_tests_mention_preselect(
    shared_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a sandbox that cannot run the tracer (a container image without it): no coverage
    monkeypatch.setattr(SolvabilityValidator, "covered_lines", lambda self, repo_dir: None)
    repo = _copy_repo(shared_dir)
    report = _generate(repo, shared_dir / "t.jsonl", ["reverse_words"])
    assert report.uncovered is None
    assert report.rejected["not_referenced"] == 1
    assert sum(report.rejected[g] for g in GATES) == 0


def test_a_trace_that_another_tracer_replaced_is_no_coverage(shared_dir: Path) -> None:
    """A suite whose start-up turns the line tracer off (as coverage.py's own tracer does
    under pytest-cov) traces no test: its coverage is unknown, not "nothing covered"."""
    repo = _copy_repo(shared_dir)
    (repo / "tests" / "conftest.py").write_text(
        "import sys\nimport threading\n\n\n"
        "def pytest_configure(config):\n"
        "    sys.settrace(None)\n"
        "    threading.settrace(None)\n"
        "    if hasattr(sys, 'monitoring') and sys.monitoring.get_tool(4):\n"
        "        sys.monitoring.set_events(4, 0)\n"
    )
    validator = SolvabilityValidator(_factory)
    assert validator.covered_lines(repo) is None
    (repo / "tests" / "conftest.py").unlink()
    covered = validator.covered_lines(repo)
    assert covered is not None and any(path.startswith("tests/test_") for path in covered)


def test_the_traced_run_turns_pytest_cov_off() -> None:
    from composer_replication.sandbox.pytest_support import traced_command

    traced = traced_command("python -m pytest -q -p pytest_cov", "trace.py", "out.json")
    assert traced is not None and traced.endswith("-p pytest_cov --no-cov")
    assert "--continue-on-collection-errors" in traced  # a module that fails stops nothing
    plain = traced_command("python -m pytest -q", "trace.py", "out.json")
    assert plain is not None and "--no-cov" not in plain


def test_gate3_rejects_a_deletion_that_breaks_collection(shared_dir: Path) -> None:
    repo = _copy_repo(shared_dir)  # `register` runs at import time as a decorator factory
    report = _generate(repo, shared_dir / "tasks.jsonl", ["register"], static_preselect=False)
    assert report.rejected["gate3_collection_ok"] == 1
    qualname, gate, reason = report.rejections[0]
    assert (qualname, gate) == ("register", "gate3_collection_ok")
    assert "collection fails with the change" in reason


def test_generate_tasks_validates_arguments(shared_dir: Path) -> None:
    with pytest.raises(ValueError, match="max_tasks must be an int >= 1"):
        generate_tasks(FD_REPO, shared_dir / "t.jsonl", max_tasks=0, sandbox_factory=_factory)
    with pytest.raises(ValueError, match="is not a directory"):
        generate_tasks(
            shared_dir / "nope",
            shared_dir / "t.jsonl",
            max_tasks=1,
            sandbox_factory=_factory,
            environment="system",
        )


def test_a_target_that_needs_the_whole_suite_is_judged_by_the_whole_suite(
    shared_dir: Path,
) -> None:
    """A doctest of a text file that finds its names only because another folder's tests ran
    first (semver's shape: tests/conftest.py fills the session's doctest namespace): run
    alone it fails even on the original code, so gate 4 judges it by the whole suite, as
    grading runs it, instead of rejecting the task."""
    repo = _copy_repo(shared_dir)
    pyproject = repo / "pyproject.toml"
    pyproject.write_text(
        pyproject.read_text().replace(
            'testpaths = ["tests"]',
            'testpaths = ["tests", "docs"]\naddopts = "--doctest-glob=*.rst"',
        )
    )
    (repo / "tests" / "conftest.py").write_text(
        "import pytest\n\n\n@pytest.fixture(autouse=True)\ndef _names(doctest_namespace):\n"
        "    from textkit.stats import mean\n\n    doctest_namespace['mean'] = mean\n"
    )
    (repo / "docs").mkdir()
    (repo / "docs" / "guide.rst").write_text("Guide\n=====\n\n>>> mean([1, 3])\n2.0\n")
    report = _generate(repo, shared_dir / "tasks.jsonl", ["mean"], split=None)
    assert report.accepted == 1, report.rejections
    (task,) = _tasks(report.output)
    assert "docs/guide.rst::guide.rst" in task.target_tests
