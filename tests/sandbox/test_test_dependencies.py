"""plan_dependencies: what a repository's tests need, from every place it declares it (test
extras, dependency groups, requirement files, tox), read without running anything."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from composer_replication.sandbox.test_dependencies import (
    pick_extra,
    plan_dependencies,
    requirement_name,
)


def _repo(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


PROJECT = """\
    [project]
    name = "My_Pkg"
    version = "1"
    dependencies = ["attrs>=20"]

    [project.optional-dependencies]
    docs = ["sphinx"]
    fast = ["orjson"]
    testing = ["hypothesis", "my-pkg[fast]"]
"""


def test_static_metadata_gives_the_test_extra_with_its_self_reference_expanded(
    tmp_path: Path,
) -> None:
    plan = plan_dependencies(_repo(tmp_path, {"pyproject.toml": PROJECT}))
    assert plan.project == "my-pkg"
    assert plan.installable
    assert plan.extras == ("testing",)
    assert plan.static_dependencies == ("attrs>=20", "hypothesis", "orjson")
    assert plan.requirements == () and plan.files == ()
    assert plan.sources == ("extras testing",)


def test_dependency_groups_with_include_group_and_dev_as_the_fallback(tmp_path: Path) -> None:
    groups = """\
        [dependency-groups]
        lint = ["ruff"]
        base = ["pytest>=8"]
        dev = [{include-group = "base"}, "pytest-xdist"]
    """
    plan = plan_dependencies(_repo(tmp_path, {"pyproject.toml": groups}))
    assert plan.groups == ("dev",)
    assert plan.requirements == ("pytest-xdist", "pytest>=8")
    assert not plan.installable  # tool settings only: no package to build
    assert plan.sources == ("[dependency-groups] dev",)


def test_a_test_group_is_preferred_to_dev(tmp_path: Path) -> None:
    groups = '[dependency-groups]\ndev = ["black"]\ntests = ["pytest"]\n'
    assert plan_dependencies(_repo(tmp_path, {"pyproject.toml": groups})).groups == ("tests",)


def test_requirement_files_named_for_tests(tmp_path: Path) -> None:
    repo = _repo(
        tmp_path,
        {
            "setup.py": "from setuptools import setup\nsetup(name='x')\n",
            "requirements.txt": "requests\n",  # runtime: the package declares it already
            "requirements-tests39.txt": "pytest==8.4\n",
            "requirements-docs.txt": "sphinx\n",
            "requirements/testing.txt": "coverage\n",
            "requirements/packaging.txt": "build\n",
            "tests/requirements.txt": "freezegun\n",
        },
    )
    plan = plan_dependencies(repo)
    names = [p.relative_to(repo.resolve()).as_posix() for p in plan.files]
    assert names == [
        "requirements-tests39.txt",
        "requirements/testing.txt",
        "tests/requirements.txt",
    ]
    assert plan.static_dependencies is None  # setup.py: only the build backend knows


def test_plain_requirements_file_counts_where_no_package_is_declared(tmp_path: Path) -> None:
    repo = _repo(tmp_path, {"requirements.txt": "requests\n", "mod.py": "X = 1\n"})
    plan = plan_dependencies(repo)
    assert [p.name for p in plan.files] == ["requirements.txt"] and not plan.installable


TOX = """\
    [tox]
    envlist = py39, py311

    [testenv]
    deps =
        pytest
        pytest-cov  # coverage in CI
        -r{toxinidir}/requirements-dev.txt
        py38: mock
        tests: hypothesis
        !tests: never
        {env:EXTRA_DEP:}
        -e .
    extras = testing
    commands = pytest {posargs}
"""


def test_tox_deps_files_extras_and_factors(tmp_path: Path) -> None:
    repo = _repo(
        tmp_path,
        {"pyproject.toml": PROJECT, "tox.ini": TOX, "requirements-dev.txt": "pretend\n"},
    )
    plan = plan_dependencies(repo)
    assert plan.requirements == ("pytest", "pytest-cov", "hypothesis")
    assert [p.name for p in plan.files] == ["requirements-dev.txt"]
    assert plan.extras == ("testing",)
    assert plan.sources == ("extras testing", "tox.ini [testenv] deps")


def test_tox_toml_env_run_base(tmp_path: Path) -> None:
    tox = """\
        [env_run_base]
        deps = ["pytest >=8", "-r requirements/unit.txt"]
        dependency_groups = ["tests"]
    """
    groups = '[project]\nname = "p"\nversion = "1"\n[dependency-groups]\ntests = ["pretend"]\n'
    repo = _repo(
        tmp_path,
        {"tox.toml": tox, "pyproject.toml": groups, "requirements/unit.txt": "mock\n"},
    )
    plan = plan_dependencies(repo)
    assert plan.groups == ("tests",)
    assert plan.requirements == ("pretend", "pytest >=8")
    assert [p.name for p in plan.files] == ["unit.txt"]
    assert "tox.toml [env_run_base] deps" in plan.sources


def test_tox_in_pyproject_legacy_string(tmp_path: Path) -> None:
    pyproject = (
        '[project]\nname = "p"\nversion = "1"\n'
        '[tool.tox]\nlegacy_tox_ini = """\n[testenv]\ndeps = pretend\n"""\n'
    )
    plan = plan_dependencies(_repo(tmp_path, {"pyproject.toml": pyproject}))
    assert plan.requirements == ("pretend",)
    assert plan.sources == ("pyproject.toml [tool.tox] legacy_tox_ini [testenv] deps",)


def test_a_broken_pyproject_is_named_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot parse .*pyproject.toml.*; fix the file"):
        plan_dependencies(_repo(tmp_path, {"pyproject.toml": "[project\n"}))


def test_names_and_extras() -> None:
    assert requirement_name("Foo_Bar[x, y] >= 1; python_version > '3'") == ("foo-bar", ["x", "y"])
    assert pick_extra(["Docs", "Testing"]) == "Testing"
    assert pick_extra(["docs", "dev"]) == "dev"
    assert pick_extra(["docs"]) is None
