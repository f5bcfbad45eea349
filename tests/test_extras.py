"""The pyproject extras the install commands of the documentation name: each maps onto the
dependency sets the project already pins (no new versions, never torch), and covers the SDK
the feature it installs imports."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
EXTRAS = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
PINNED = set(EXTRAS["cloud"]) | set(EXTRAS["docker"])  # the sets the new extras draw from


def names(extra: str) -> set[str]:
    return {Requirement(r).name.lower().replace("_", "-") for r in EXTRAS[extra]}


@pytest.mark.parametrize(
    ("extra", "needs"),
    [
        ("eks", {"kubernetes"}),  # EKSExecutor
        ("aws", {"boto3"}),  # SageMakerExecutor
        ("serverless", {"kubernetes", "boto3", "s3fs", "huggingface-hub"}),
        ("datagen", {"docker"}),  # DockerSandbox
    ],
)
def test_documented_extra_exists_and_maps_onto_the_pinned_sets(extra, needs):
    assert extra in EXTRAS
    assert needs <= names(extra)
    assert set(EXTRAS[extra]) <= PINNED, set(EXTRAS[extra]) - PINNED
    assert "torch" not in names(extra)


def test_serverless_pulls_both_cloud_executors():
    assert names("eks") | names("aws") <= names("serverless")
