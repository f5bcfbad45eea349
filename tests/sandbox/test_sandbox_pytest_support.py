"""pytest command lines, the junit parser and the portable pytest bundle."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from composer_replication.sandbox.base import GuardSpec
from composer_replication.sandbox.behaviour_guard import GUARD_ENV, GUARD_PLUGIN
from composer_replication.sandbox.process import ProcessOutcome
from composer_replication.sandbox.pytest_support import (
    JUNIT_PREFIX,
    SYSTEM_PYTHON,
    build_pytest_argv,
    bundle_distributions,
    entry_for_tests,
    guard_site_dir,
    interpreter_bin_dir,
    parse_junit,
    pytest_bundle_dir,
    result_of_tests,
    sandbox_python,
)

REPORT = [
    "-p", "no:cacheprovider", "--color=no", "--continue-on-collection-errors",
    "--junitxml=/w/j.xml", "-o", "junit_family=xunit1"
]  # fmt: skip


@pytest.mark.parametrize(
    ("command", "tests", "argv", "is_pytest"),
    [
        ("pytest -q", ["t.py::a"], ["/py", "-m", "pytest", *REPORT, "-q", "t.py::a"], True),
        ("python -m pytest -x", [], ["/py", "-m", "pytest", *REPORT, "-x"], True),
        ("python3.11 -m pytest", [], ["/py", "-m", "pytest", *REPORT], True),
        ("/opt/py -m pytest", [], ["/opt/py", "-m", "pytest", *REPORT], True),
        ("python check.py", ["x"], ["/py", "check.py", "x"], False),
        ("make test", [], ["make", "test"], False),
    ],
)
def test_build_pytest_argv(
    command: str, tests: list[str], argv: list[str], is_pytest: bool
) -> None:
    assert build_pytest_argv(command, tests, python="/py", junit_path="/w/j.xml") == (
        argv,
        is_pytest,
    )


def test_build_pytest_argv_rejects_option_like_test_ids_and_empty_commands() -> None:
    with pytest.raises(ValueError, match="must be non-empty strings"):
        build_pytest_argv("pytest", ["-p", "evil"], python="/py", junit_path="/j")
    with pytest.raises(ValueError, match="test_command is empty"):
        build_pytest_argv("  ", [], python="/py", junit_path="/j")


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="3" skipped="1" tests="10">
<testcase classname="tests.test_a" name="test_ok" file="tests/test_a.py" line="1" time="0"/>
<testcase classname="tests.test_a" name="test_bad" file="tests/test_a.py" line="4" time="0">
  <failure message="assert 0">boom</failure></testcase>
<testcase classname="tests.test_a.TestK.Inner" name="test_p[1.5-x]" file="tests/test_a.py"
  line="9" time="0"/>
<testcase classname="tests.test_a" name="test_skip" file="tests/test_a.py" line="12" time="0">
  <skipped type="pytest.skip" message="no">no</skipped></testcase>
<testcase classname="tests.test_a" name="test_teardown" file="tests/test_a.py" line="15" time="0">
  <failure message="x">x</failure><error message="teardown">y</error></testcase>
<testcase classname="tests.test_lru.LRUCacheTest" name="test_missing" file="tests/__init__.py"
  line="20" time="0"/>
<testcase classname="tests.test_ttl.TTLCacheTest" name="test_missing" file="tests/__init__.py"
  line="20" time="0"><failure message="x">x</failure></testcase>
<testcase classname="docs.use-it.rst" name="use-it.rst" file="docs/use-it.rst" line="0" time="0"/>
<testcase classname="pkg.mod" name="pkg.mod.f" file="pkg/mod.py" line="1" time="0"/>
<testcase classname="" name="tests.test_b" file="tests/test_b.py" time="0">
  <error message="collection failure">ImportError</error></testcase>
</testsuite></testsuites>
"""


def test_parse_junit_maps_node_ids_and_outcomes(tmp_path: Path) -> None:
    path = tmp_path / "j.xml"
    path.write_text(JUNIT)
    report = parse_junit(path)
    assert report is not None
    assert report.outcomes == {
        "tests/test_a.py::test_ok": "passed",
        "tests/test_a.py::test_bad": "failed",
        "tests/test_a.py::TestK::Inner::test_p[1.5-x]": "passed",
        "tests/test_a.py::test_skip": "skipped",
        "tests/test_a.py::test_teardown": "failed",
        # a test a class inherits from a mixin in another file: the collecting class's id
        "tests/test_lru.py::LRUCacheTest::test_missing": "passed",
        "tests/test_ttl.py::TTLCacheTest::test_missing": "failed",
        # doctests of a text file (--doctest-glob) and of a module (--doctest-modules)
        "docs/use-it.rst::use-it.rst": "passed",
        "pkg/mod.py::pkg.mod.f": "passed",
        "tests/test_b.py": "error",
    }
    assert (report.passed, report.failed, report.errors, report.skipped) == (5, 3, 1, 1)


def test_parse_junit_refuses_missing_malformed_and_symlinked_reports(tmp_path: Path) -> None:
    assert parse_junit(tmp_path / "missing.xml") is None
    bad = tmp_path / "bad.xml"
    bad.write_text("<testsuite><testcase")
    assert parse_junit(bad) is None
    good = tmp_path / "good.xml"
    good.write_text(JUNIT)
    link = tmp_path / "link.xml"
    link.symlink_to(good)
    assert parse_junit(link) is None


def test_bundle_resolves_pytest_requirements_from_metadata() -> None:
    names = {d.metadata["Name"].lower() for d in bundle_distributions()}
    assert {"pytest", "pluggy", "iniconfig", "packaging"} <= names
    assert not names & {"hypothesis", "torch"}  # dev extras are not followed


@pytest.mark.integration
def test_bundle_imports_under_the_system_interpreter_as_nobody() -> None:
    site = pytest_bundle_dir()
    assert site == pytest_bundle_dir()  # built once per process
    assert (site / "_pytest").is_dir() and (site / "pluggy").is_dir()
    assert oct(os.stat(site).st_mode & 0o777) == "0o755"
    if not os.access("/usr/bin/python3", os.X_OK) or os.geteuid() != 0:
        pytest.skip("needs root and /usr/bin/python3")
    bin_dir = interpreter_bin_dir("/usr/bin/python3")
    proc = subprocess.run(
        [str(bin_dir / "pytest"), "--version"],
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        user=65534,
        group=65534,
        extra_groups=[],
        cwd="/",
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("pytest ")


def test_the_python_shim_starts_a_virtualenv_as_itself(tmp_path: Path) -> None:
    # a link to a venv's interpreter would start the base Python; the shim keeps the venv
    venv = tmp_path / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True)
    bin_dir = interpreter_bin_dir(str(venv / "bin" / "python"))
    for command in ("python", "python3"):
        assert not (bin_dir / command).is_symlink()
        out = subprocess.run(
            [str(bin_dir / command), "-c", "import sys; print(sys.prefix)"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip() == str(venv)


# --- the entry every backend executes, and its result -------------------------------------
GUARD = GuardSpec(protected=("tests/test_calc.py",), candidates=("calc.py",))


def _report_name(argv: list[str]) -> str:
    (option,) = [a for a in argv if a.startswith("--junitxml=")]
    return option.removeprefix("--junitxml=")


def test_an_entry_on_the_host_writes_its_report_into_the_workdir(tmp_path: Path) -> None:
    entry = entry_for_tests("pytest -q", ["t.py"], python="/py", workdir=tmp_path)
    junit = _report_name(entry.argv)
    assert entry.argv == ["/py", "-m", "pytest", *REPORT[:4], f"--junitxml={junit}", *REPORT[5:],
                          "-q", "t.py"]  # fmt: skip
    assert entry.report == tmp_path / Path(junit).name and str(entry.report) == junit
    assert entry.report.name.startswith(JUNIT_PREFIX)
    assert (entry.env, entry.guarded) == ({}, False)
    # a fresh report name per run
    assert entry_for_tests("pytest", [], python="/py", workdir=tmp_path).report != entry.report


def test_a_guarded_entry_on_the_host_sets_the_guard_variables(tmp_path: Path) -> None:
    entry = entry_for_tests(
        "pytest", [], python="/py", workdir=tmp_path, guard=GUARD, with_bundle=True
    )
    assert entry.guarded and entry.argv[:3] == ["/py", "-m", "pytest"]
    assert entry.env["PYTHONPATH"] == f"{guard_site_dir()}:{pytest_bundle_dir()}"
    assert entry.env["PYTEST_PLUGINS"] == GUARD_PLUGIN
    assert json.loads(entry.env[GUARD_ENV])["root"] == str(tmp_path)


def test_a_guarded_entry_in_a_container_wraps_the_command(tmp_path: Path) -> None:
    entry = entry_for_tests(
        "python -m pytest", ["t.py"], python="python", workdir=tmp_path, inside="/src",
        guard=GUARD, guard_mount="/guard",
    )  # fmt: skip
    junit = _report_name(entry.argv)
    assert junit.startswith(f"/src/{JUNIT_PREFIX}")  # the path the container sees
    assert entry.report == tmp_path / Path(junit).name  # read on the host
    assert entry.argv[:2] == ["sh", "-c"] and entry.argv[3:6] == ["sh", "/guard", GUARD_PLUGIN]
    assert entry.argv[6:9] == ["python", "-m", "pytest"] and entry.argv[-1] == "t.py"
    assert set(entry.env) == {GUARD_ENV}  # the image keeps its own PYTHONPATH
    assert json.loads(entry.env[GUARD_ENV])["root"] == "/src"


def test_a_command_that_is_not_pytest_has_no_report(tmp_path: Path) -> None:
    entry = entry_for_tests("make test", ["x"], python="/py", workdir=tmp_path)
    assert (entry.argv, entry.report) == (["make", "test", "x"], None)
    result = result_of_tests(entry, _outcome(2, b"boom"), timeout_s=5, isolated=True)
    assert (result.passed, result.failed, result.errors, result.exit_code) == (0, 0, 0, 2)
    assert result.output == "boom\n[exit code 2]" and result.isolated


def _outcome(exit_code: int | None, output: bytes, stopped: str | None = None) -> ProcessOutcome:
    return ProcessOutcome(exit_code, output, len(output), False, False, 0.5, stopped=stopped)


def test_the_result_reads_and_removes_the_report(tmp_path: Path) -> None:
    entry = entry_for_tests("pytest", [], python="/py", workdir=tmp_path, guard=GUARD)
    assert entry.report is not None
    entry.report.write_text(JUNIT)
    result = result_of_tests(
        entry, _outcome(1, b"out\n"), timeout_s=5, isolated=False, infrastructure_error=None
    )
    assert (result.passed, result.failed, result.errors, result.skipped) == (5, 3, 1, 1)
    assert result.exit_code == 1 and result.duration_s == 0.5 and not result.isolated
    assert result.output == "out\n\n[exit code 1]" and result.behaviour_flags == ()
    assert not entry.report.exists()


def test_a_missing_report_or_a_stopped_run_fails_closed(tmp_path: Path) -> None:
    entry = entry_for_tests("pytest", [], python="/py", workdir=tmp_path)
    assert result_of_tests(entry, _outcome(0, b""), timeout_s=5, isolated=True).errors == 1
    assert entry.report is not None
    entry.report.write_text(JUNIT)
    stopped = result_of_tests(entry, _outcome(None, b"", "over quota"), timeout_s=5, isolated=True)
    assert (stopped.passed, stopped.errors) == (0, 1)
    assert stopped.output == "\n[stopped: over quota; process group killed]"


def test_the_sandbox_python_is_the_system_one_where_it_runs() -> None:
    if os.access(SYSTEM_PYTHON, os.X_OK):
        assert sandbox_python() == SYSTEM_PYTHON
    else:
        assert os.access(sandbox_python(), os.X_OK)
