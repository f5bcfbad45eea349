"""The declared Python range is the tested one: on every interpreter in ``requires-python``
found on this machine, the package and its config layer import and load every shipped
config without torch.

Each interpreter gets a cached virtualenv holding only the torch-free dependencies the
config layer needs (their pins read from pyproject.toml); ``src/`` goes on ``sys.path``
instead of installing the package, whose dependencies include torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from composer_replication.config.run import tomllib

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
REQUIRES_PYTHON = SpecifierSet(PYPROJECT["project"]["requires-python"])
# what `composer_replication.config` imports besides the standard library
CONFIG_LAYER_DEPENDENCIES = ("pydantic", "tomli", "typing_extensions")
HEAVY_MODULES = ("torch", "transformers", "trl", "numpy")

# Runs in the other interpreter: import the package and the config layer, load every
# shipped config, and report which heavy modules got imported.
PROBE = """
import json, sys
from pathlib import Path

import composer_replication
import composer_replication.config
from composer_replication.config import AlgorithmConfig, RunConfig

root = Path(sys.argv[1])
loaded = []
for path in sorted((root / "configs" / "runs").glob("*.toml")):
    RunConfig.from_toml(path)
    loaded.append("runs/" + path.name)
for path in sorted((root / "configs" / "algorithms").glob("*.toml")):
    AlgorithmConfig.from_toml(path)
    loaded.append("algorithms/" + path.name)
heavy = [name for name in json.loads(sys.argv[2]) if name in sys.modules]
print(json.dumps({"version": composer_replication.__version__, "loaded": loaded, "heavy": heavy}))
"""


def config_layer_requirements() -> list[str]:
    """The pyproject requirement strings (markers kept) of the config layer's dependencies."""
    wanted = []
    for line in PYPROJECT["project"]["dependencies"]:
        if Requirement(line).name.lower().replace("-", "_") in CONFIG_LAYER_DEPENDENCIES:
            wanted.append(line)
    assert len(wanted) == len(CONFIG_LAYER_DEPENDENCIES), wanted
    return wanted


def _candidate_binaries() -> list[Path]:
    """``python3.X`` files on PATH and under ~/.pyenv/versions, real binaries first."""
    found = sorted(
        (Path.home() / ".pyenv" / "versions").glob("*/bin/python3.*"),
        key=lambda p: (
            Version(p.parents[1].name)
            if re.fullmatch(r"[\d.]+", p.parents[1].name)
            else Version("0")
        ),
        reverse=True,  # the newest patch release of each minor version first
    )
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if directory:
            found.extend(sorted(Path(directory).glob("python3.*")))
    return [p for p in found if re.fullmatch(r"python3\.\d+", p.name)]


def other_interpreters() -> dict[str, Path]:
    """``"3.X"`` -> a working interpreter, for each minor version in the declared range
    other than the one running the tests."""
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    chosen: dict[str, Path] = {}
    for path in _candidate_binaries():
        minor = path.name.removeprefix("python")
        if minor in chosen or minor == running or Version(minor) not in REQUIRES_PYTHON:
            continue
        try:  # a pyenv shim for a version not selected exits non-zero
            out = subprocess.run(
                [str(path), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                capture_output=True, text=True, timeout=30, check=True,
            ).stdout.strip()  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            continue
        if out == minor:
            chosen[minor] = path
    return dict(sorted(chosen.items(), key=lambda item: Version(item[0])))


INTERPRETERS = other_interpreters()


def _venv_root(config: pytest.Config) -> Path:
    cache = getattr(config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("python-range"))
    return Path(tempfile.gettempdir()) / "composer-replication-python-range"


def config_layer_venv(interpreter: Path, config: pytest.Config) -> Path:
    """The python of a cached venv for ``interpreter`` with only the config layer's
    dependencies, keyed on the interpreter and the requirement set."""
    requirements = config_layer_requirements()
    version = subprocess.run(
        [str(interpreter), "-c", "import sys; print(sys.version)"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    key = hashlib.sha256(
        json.dumps([str(interpreter.resolve()), version, requirements]).encode()
    ).hexdigest()[:16]
    venv = _venv_root(config) / f"py{interpreter.name.removeprefix('python')}-{key}"
    python = venv / "bin" / "python"
    ready = venv / ".ready"
    if ready.exists():
        return python
    shutil.rmtree(venv, ignore_errors=True)  # a half-built one from an interrupted run
    subprocess.run([str(interpreter), "-m", "venv", str(venv)], check=True, timeout=300)
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         *requirements],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert install.returncode == 0, f"pip install {requirements} failed:\n{install.stderr}"
    ready.write_text(json.dumps(requirements))
    return python


def test_the_range_is_parsed_from_pyproject():
    assert Version(f"{sys.version_info.major}.{sys.version_info.minor}") in REQUIRES_PYTHON
    assert "torch" not in {Requirement(r).name for r in config_layer_requirements()}


@pytest.mark.parametrize("minor", list(INTERPRETERS) or ["none"])
def test_config_layer_runs_without_torch(minor: str, pytestconfig: pytest.Config):
    if minor == "none":
        pytest.skip(
            f"no interpreter in requires-python {REQUIRES_PYTHON} other than the running "
            f"{sys.version_info.major}.{sys.version_info.minor} on PATH or ~/.pyenv/versions"
        )
    python = config_layer_venv(INTERPRETERS[minor], pytestconfig)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = str(ROOT / "src")
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # leave no other interpreter's .pyc in src/
    result = subprocess.run(
        [str(python), "-c", PROBE, str(ROOT), json.dumps(HEAVY_MODULES)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, f"Python {minor}:\n{result.stderr}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    shipped = sorted((ROOT / "configs").glob("*/*.toml"))
    assert len(report["loaded"]) == len(shipped) > 0
    assert report["heavy"] == []
