"""pytest command lines, the junit parser and the portable pytest bundle."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from composer_replication.sandbox.pytest_support import (
    build_pytest_argv,
    bundle_distributions,
    interpreter_bin_dir,
    parse_junit,
    pytest_bundle_dir,
)

REPORT = [
    "-p", "no:cacheprovider", "--color=no", "--junitxml=/w/j.xml", "-o", "junit_family=xunit1"
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
<testsuites><testsuite name="pytest" errors="1" failures="2" skipped="1" tests="6">
<testcase classname="tests.test_a" name="test_ok" file="tests/test_a.py" line="1" time="0"/>
<testcase classname="tests.test_a" name="test_bad" file="tests/test_a.py" line="4" time="0">
  <failure message="assert 0">boom</failure></testcase>
<testcase classname="tests.test_a.TestK.Inner" name="test_p[1.5-x]" file="tests/test_a.py"
  line="9" time="0"/>
<testcase classname="tests.test_a" name="test_skip" file="tests/test_a.py" line="12" time="0">
  <skipped type="pytest.skip" message="no">no</skipped></testcase>
<testcase classname="tests.test_a" name="test_teardown" file="tests/test_a.py" line="15" time="0">
  <failure message="x">x</failure><error message="teardown">y</error></testcase>
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
        "tests/test_b.py": "error",
    }
    assert (report.passed, report.failed, report.errors, report.skipped) == (2, 2, 1, 1)


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
