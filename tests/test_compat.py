"""The supported transformers range: one constant, the same in pyproject.toml, checked by
the commands before they load a model; and the cache keyword of each release."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from typer.testing import CliRunner

from composer_replication.cli import app
from composer_replication.common import compat
from composer_replication.common.compat import (
    SUPPORTED_TRANSFORMERS,
    cache_keyword,
    check_transformers_version,
)

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_pyproject_declares_the_supported_range():
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    declared = [r.specifier for r in map(Requirement, dependencies) if r.name == "transformers"]
    assert declared == [SpecifierSet(SUPPORTED_TRANSFORMERS)]


@pytest.mark.parametrize("installed", ["5.17.0", "5.20.2", "5.24.0", "5.24.1+local", "5.18.0rc1"])
def test_a_supported_release_passes(installed):
    check_transformers_version(installed)


@pytest.mark.parametrize("installed", ["4.56.2", "5.16.1", "5.25.0", "5.25.0.dev0", "6.0.0", "x"])
def test_an_unsupported_release_is_named_with_the_fix(installed):
    with pytest.raises(ValueError) as err:
        check_transformers_version(installed)
    message = str(err.value)
    assert "\n" not in message
    assert f"transformers {installed} is installed" in message
    assert f"supports transformers {SUPPORTED_TRANSFORMERS}" in message
    assert message.endswith(f"pip install 'transformers{SUPPORTED_TRANSFORMERS}'")


def test_the_installed_release_is_supported():
    check_transformers_version(compat.installed_transformers())


@pytest.mark.parametrize("command", [["smoke"], ["train"], ["eval", "embedded"]])
def test_commands_stop_on_an_unsupported_release_with_one_line(monkeypatch, command):
    monkeypatch.setattr(compat, "installed_transformers", lambda: "4.40.0")
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert lines == [
        f"Error: transformers 4.40.0 is installed; composer-replication supports transformers "
        f"{SUPPORTED_TRANSFORMERS}: pip install 'transformers{SUPPORTED_TRANSFORMERS}'"
    ]


def test_the_cache_keyword_follows_the_rename_in_5_24():
    assert cache_keyword("5.17.0") == cache_keyword("5.23.0") == "past_key_values"
    assert cache_keyword("5.24.0") == cache_keyword("5.24.0.dev0") == "cache"
