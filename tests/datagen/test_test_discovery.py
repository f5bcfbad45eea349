"""discover_tests: the pytest command and the collected test modules of small repositories
shaped like real ones (pytest config in each of its files, a unittest `tests.py`, a `tests/`
package, src layout, `python_files`), checked against pytest's own collection, and a
unittest-only repository run through the real sandbox."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from composer_replication.datagen.test_discovery import DiscoveredTests, discover_tests
from composer_replication.sandbox.local import LocalSubprocessSandbox

UNITTEST_MODULE = """\
import unittest

import {module}


class {name}(unittest.TestCase):
    def test_one(self):
        self.assertEqual({module}.VALUE, 1)
"""
PYTEST_MODULE = """\
import pytest


def test_value():
    assert pytest.approx(1.0) == 1.0
"""
PLAIN_MODULE = "def test_plain():\n    assert True\n"


def _repo(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


# ---- repositories with a pytest configuration ----------------------------------------------


def pytest_ini_repo(root: Path) -> Path:
    return _repo(
        root,
        {
            "pytest.ini": "[pytest]\ntestpaths = tests\n",
            "pkg/__init__.py": "VALUE = 1\n",
            "tests/__init__.py": "",
            "tests/test_a.py": PLAIN_MODULE,
            "tests/conftest.py": "",
            "test_outside.py": PLAIN_MODULE,  # outside testpaths: not collected
        },
    )


def pyproject_repo(root: Path) -> Path:
    """python-slugify's shape: [tool.pytest.ini_options] testpaths = ["tests"]."""
    return _repo(
        root,
        {
            "pyproject.toml": """\
                [project]
                name = "slug"
                dependencies = ["text-unidecode>=1.3"]

                [tool.pytest.ini_options]
                testpaths = ["tests"]
                addopts = "--color=yes"
                """,
            "slug/__init__.py": "VALUE = 1\n",
            "tests/__init__.py": "",
            "tests/test_slug.py": PLAIN_MODULE,
            "tests/helpers.py": "",
            "tools/test_release_script.py": PLAIN_MODULE,
        },
    )


def tox_ini_repo(root: Path) -> Path:
    """[pytest] in tox.ini with a python_files override (check_*.py)."""
    return _repo(
        root,
        {
            "tox.ini": "[tox]\nenvlist = py311\n\n[pytest]\npython_files = check_*.py\n",
            "lib.py": "VALUE = 1\n",
            "tests/check_lib.py": PLAIN_MODULE,
            "tests/test_not_by_this_config.py": PLAIN_MODULE,
        },
    )


def setup_cfg_repo(root: Path) -> Path:
    """six's shape: [tool:pytest] with only minversion; collects from the root, skipping
    hidden, build, venv and egg-info directories."""
    return _repo(
        root,
        {
            "setup.cfg": "[flake8]\nmax-line-length = 100\n\n[tool:pytest]\nminversion = 2.2.0\n",
            "six.py": "VALUE = 1\n",
            "test_six.py": PLAIN_MODULE,
            "build/lib/test_six.py": PLAIN_MODULE,
            ".tox/py311/test_x.py": PLAIN_MODULE,
            "venv/test_y.py": PLAIN_MODULE,
            "six.egg-info/PKG-INFO": "",
        },
    )


def configured_docs_repo(root: Path) -> Path:
    """A configuration without testpaths and test modules where we never search (docs,
    egg-info): the bare run would collect them, so the command leaves them out."""
    return _repo(
        root,
        {
            "pyproject.toml": '[tool.pytest.ini_options]\naddopts = "-ra"\n',
            "tests/test_mod.py": PLAIN_MODULE,
            "docs/examples/test_example.py": PLAIN_MODULE,
            "mod.egg-info/test_odd.py": PLAIN_MODULE,
        },
    )


def toolz_repo(root: Path) -> Path:
    """toolz's shape: testpaths is the package, with tests in nested packages."""
    return _repo(
        root,
        {
            "pyproject.toml": '[tool.pytest.ini_options]\ntestpaths = ["toolz"]\n',
            "toolz/__init__.py": "VALUE = 1\n",
            "toolz/tests/test_core.py": PLAIN_MODULE,
            "toolz/sandbox/tests/test_parallel.py": PLAIN_MODULE,
            "toolz/sandbox/core.py": "",
        },
    )


def native_toml_repo(root: Path) -> Path:
    """pytest 9's native [tool.pytest] table, with python_files as a TOML list."""
    return _repo(
        root,
        {
            "pyproject.toml": (
                '[tool.pytest]\ntestpaths = ["spec"]\npython_files = ["*_spec.py"]\n'
            ),
            "spec/thing_spec.py": PLAIN_MODULE,
            "spec/test_thing.py": PLAIN_MODULE,
        },
    )


def precedence_repo(root: Path) -> Path:
    """pytest.ini wins over pyproject.toml's table, as in pytest."""
    return _repo(
        root,
        {
            "pytest.ini": "[pytest]\ntestpaths = a\n",
            "pyproject.toml": '[tool.pytest.ini_options]\ntestpaths = ["b"]\n',
            "a/test_a.py": PLAIN_MODULE,
            "b/test_b.py": PLAIN_MODULE,
        },
    )


# ---- repositories without one -------------------------------------------------------------


def unittest_tests_py_repo(root: Path) -> Path:
    """jsonpointer's shape: a module, a unittest `tests.py`, a makefile running unittest."""
    return _repo(
        root,
        {
            "pyproject.toml": '[build-system]\nrequires = ["setuptools>=77.0"]\n',
            "setup.cfg": "[flake8]\nexclude = .git,.tox,dist,doc\n",
            "makefile": "test:\n\tpython3 -munittest\n",
            "jsonpointer.py": "VALUE = 1\n",
            "tests.py": UNITTEST_MODULE.format(module="jsonpointer", name="SpecificationTests"),
            "doc/conf.py": "",
        },
    )


def unittest_package_repo(root: Path) -> Path:
    """more-itertools' shape: unittest TestCases in tests/test_*.py, tox runs unittest."""
    return _repo(
        root,
        {
            "tox.ini": "[testenv]\ncommands = {envpython} -m unittest -v {posargs}\n",
            "more/__init__.py": "VALUE = 1\n",
            "tests/__init__.py": "",
            "tests/test_more.py": UNITTEST_MODULE.format(module="more", name="MoreTests"),
            "tests/test_recipes.py": UNITTEST_MODULE.format(module="more", name="RecipeTests"),
            "docs/conf.py": "",
        },
    )


def pytest_root_module_repo(root: Path) -> Path:
    """inflection's shape: one pytest module at the root, no configuration."""
    return _repo(root, {"inflection.py": "VALUE = 1\n", "test_inflection.py": PYTEST_MODULE})


def src_layout_repo(root: Path) -> Path:
    return _repo(
        root,
        {
            "pyproject.toml": '[project]\nname = "pkg"\n',
            "src/pkg/__init__.py": "VALUE = 1\n",
            "tests/test_pkg.py": UNITTEST_MODULE.format(module="pkg", name="PkgTests"),
        },
    )


def src_layout_configured_repo(root: Path) -> Path:
    """src layout whose configuration sets pythonpath itself: nothing is added."""
    return _repo(
        root,
        {
            "pyproject.toml": '[tool.pytest.ini_options]\npythonpath = ["src"]\n',
            "src/pkg/__init__.py": "VALUE = 1\n",
            "tests/test_pkg.py": PLAIN_MODULE,
        },
    )


def mixed_repo(root: Path) -> Path:
    """A unittest `tests.py` beside a tests/ package: both named on the command line."""
    return _repo(
        root,
        {
            "mod.py": "VALUE = 1\n",
            "tests.py": UNITTEST_MODULE.format(module="mod", name="Legacy"),
            "tests/test_new.py": PYTEST_MODULE,
            "testing_helpers.py": "HELP = 1\n",  # test*.py without TestCases: not a test
        },
    )


def docs_test_repo(root: Path) -> Path:
    """A test module under docs/ that a bare pytest run would collect: named explicitly."""
    return _repo(
        root,
        {
            "mod.py": "VALUE = 1\n",
            "tests/test_mod.py": PLAIN_MODULE,
            "docs/test_examples.py": PLAIN_MODULE,
        },
    )


Case = tuple[Callable[[Path], Path], str, tuple[str, ...], str, str]
CASES: dict[str, Case] = {
    # name: (builder, command, test_files, framework, source)
    "pytest.ini": (
        pytest_ini_repo,
        "python -m pytest -q",
        ("tests/test_a.py",),
        "pytest",
        "pytest.ini [pytest] testpaths = ['tests']",
    ),
    "pyproject.toml": (
        pyproject_repo,
        "python -m pytest -q",
        ("tests/test_slug.py",),
        "pytest",
        "pyproject.toml [tool.pytest.ini_options] testpaths = ['tests']",
    ),
    "tox.ini": (
        tox_ini_repo,
        "python -m pytest -q",
        ("tests/check_lib.py",),
        "pytest",
        "tox.ini [pytest] python_files = ['check_*.py']",
    ),
    "setup.cfg": (
        setup_cfg_repo,
        "python -m pytest -q",
        ("test_six.py",),
        "pytest",
        "setup.cfg [tool:pytest] no testpaths: collects from the repository root",
    ),
    "configured-docs": (
        configured_docs_repo,
        "python -m pytest -q --ignore=docs --ignore=mod.egg-info",
        ("tests/test_mod.py",),
        "pytest",
        "pyproject.toml [tool.pytest.ini_options] no testpaths: collects from the repository root",
    ),
    "toolz": (
        toolz_repo,
        "python -m pytest -q",
        ("toolz/sandbox/tests/test_parallel.py", "toolz/tests/test_core.py"),
        "pytest",
        "pyproject.toml [tool.pytest.ini_options] testpaths = ['toolz']",
    ),
    "native-toml": (
        native_toml_repo,
        "python -m pytest -q",
        ("spec/thing_spec.py",),
        "pytest",
        "pyproject.toml [tool.pytest] testpaths = ['spec'], python_files = ['*_spec.py']",
    ),
    "precedence": (
        precedence_repo,
        "python -m pytest -q",
        ("a/test_a.py",),
        "pytest",
        "pytest.ini [pytest] testpaths = ['a']",
    ),
    "unittest-tests.py": (
        unittest_tests_py_repo,
        "python -m pytest -q tests.py",
        ("tests.py",),
        "unittest",
        "unittest modules matching test*.py: tests.py",
    ),
    "unittest-package": (
        unittest_package_repo,
        "python -m pytest -q",
        ("tests/test_more.py", "tests/test_recipes.py"),
        "unittest",
        "pytest default discovery (test_*.py, *_test.py)",
    ),
    "pytest-root-module": (
        pytest_root_module_repo,
        "python -m pytest -q",
        ("test_inflection.py",),
        "pytest",
        "pytest default discovery (test_*.py, *_test.py)",
    ),
    "src-layout": (
        src_layout_repo,
        "python -m pytest -q -o pythonpath=src",
        ("tests/test_pkg.py",),
        "unittest",
        "pytest default discovery (test_*.py, *_test.py); src layout: -o pythonpath=src",
    ),
    "src-layout-configured": (
        src_layout_configured_repo,
        "python -m pytest -q",
        ("tests/test_pkg.py",),
        "pytest",
        "pyproject.toml [tool.pytest.ini_options] no testpaths: collects from the repository root",
    ),
    "mixed": (
        mixed_repo,
        "python -m pytest -q tests tests.py",
        ("tests.py", "tests/test_new.py"),
        "pytest",
        "unittest modules matching test*.py: tests.py",
    ),
    "docs-test": (
        docs_test_repo,
        "python -m pytest -q tests",
        ("tests/test_mod.py",),
        "pytest",
        "pytest default discovery (test_*.py, *_test.py)",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_discovered_command_and_files(case: str, tmp_path: Path) -> None:
    build, command, files, framework, source = CASES[case]
    found = discover_tests(build(tmp_path / "repo"))
    assert found.command == command
    assert found.test_files == files
    assert found.framework == framework
    assert found.source == source


def test_configuration_file_and_conftests_are_reported(tmp_path: Path) -> None:
    found = discover_tests(pytest_ini_repo(tmp_path / "repo"))
    assert found == DiscoveredTests(
        command="python -m pytest -q",
        framework="pytest",
        test_files=("tests/test_a.py",),
        source="pytest.ini [pytest] testpaths = ['tests']",
        config_file="pytest.ini",
        conftest_files=("tests/conftest.py",),
    )
    assert discover_tests(unittest_tests_py_repo(tmp_path / "u")).config_file is None


def test_ignore_in_addopts_leaves_modules_out(tmp_path: Path) -> None:
    repo = _repo(
        tmp_path / "repo",
        {
            "setup.cfg": "[tool:pytest]\naddopts = -ra --ignore=tests/slow\n",
            "tests/test_fast.py": PLAIN_MODULE,
            "tests/slow/test_slow.py": PLAIN_MODULE,
        },
    )
    assert discover_tests(repo).test_files == ("tests/test_fast.py",)


def test_no_test_modules_is_an_error_naming_the_repository(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "empty", {"mod.py": "VALUE = 1\n", "testing_helpers.py": ""})
    with pytest.raises(ValueError, match=rf"no test modules found in repository '{repo}'"):
        discover_tests(repo)
    configured = _repo(tmp_path / "conf", {"pytest.ini": "[pytest]\ntestpaths = tests\n"})
    with pytest.raises(ValueError, match=r"searched by pytest.ini \[pytest\]"):
        discover_tests(configured)


def test_missing_repository_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"is not a directory; pass the repository root"):
        discover_tests(tmp_path / "nope")


def _collected_by_pytest(repo: Path, command: str) -> tuple[str, ...]:
    """The modules pytest itself collects with ``command`` (the reference)."""
    args = shlex.split(command)[3:]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        },
    )
    found = {
        m.group(1)
        for line in out.stdout.splitlines()
        if (m := re.match(r"(\S+\.py)(?::: |: \d+$)", line))
    }
    return tuple(sorted(found))


@pytest.mark.integration
@pytest.mark.parametrize("case", sorted(CASES))
def test_pytest_collects_exactly_the_discovered_files(case: str, tmp_path: Path) -> None:
    repo = CASES[case][0](tmp_path / "repo")
    found = discover_tests(repo)
    assert _collected_by_pytest(repo, found.command) == found.test_files


@pytest.mark.integration
def test_unittest_repository_runs_in_the_sandbox(shared_dir: Path) -> None:
    repo = _repo(
        shared_dir / "calc",
        {
            "calc.py": "def add(a, b):\n    return a + b\n",
            "tests.py": """\
                import unittest

                import calc


                class CalcTests(unittest.TestCase):
                    def test_adds(self):
                        self.assertEqual(calc.add(2, 3), 5)

                    def test_wrong_on_purpose(self):
                        self.assertEqual(calc.add(2, 2), 5)
                """,
        },
    )
    found = discover_tests(repo)
    assert found.command == "python -m pytest -q tests.py"
    sandbox = LocalSubprocessSandbox(repo, exec_timeout_s=60)
    try:
        result = sandbox.run_tests(found.command, ())
    finally:
        sandbox.close()
    assert result.infrastructure_error is None
    assert result.outcomes == {
        "tests.py::CalcTests::test_adds": "passed",
        "tests.py::CalcTests::test_wrong_on_purpose": "failed",
    }
