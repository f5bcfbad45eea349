"""build_repo_environment: a venv of what a repository's tests need, built offline from a
wheelhouse: the repository installed from its work tree (its metadata and entry points in
the venv, its code never), its declared test dependencies, pytest and the plugins it
declares; reused through its marker, failing in one line; and (integration) the
repository's tests passing in the real sandbox with it, from a copy at another path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from composer_replication.common.pids import pid_alive
from composer_replication.sandbox import virtualenv
from composer_replication.sandbox.local import LocalSubprocessSandbox
from composer_replication.sandbox.virtualenv import (
    MARKER,
    RepoEnvironment,
    build_repo_environment,
)
from composer_replication.sandbox.workdir import make_shared_tempdir
from composer_replication.sandbox.worktree_install import site_packages
from composer_replication.testing.wheels import pure_wheel, runner_wheels

TEST_MODULE = """\
import tinydep
import tinyextra

import tinyrepo


def test_uses_its_dependencies():
    assert tinyrepo.double_answer() == 2 * tinydep.ANSWER + tinyextra.BONUS
"""


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wheels of tinydep 1.0, tinyextra 2.0, pytest (with what it requires) and setuptools."""
    house = tmp_path_factory.mktemp("wheelhouse")
    pure_wheel(house, "tinydep", "1.0", "ANSWER = 21\n")
    pure_wheel(house, "tinyextra", "2.0", "BONUS = 100\n")
    runner_wheels(house)
    return house


RUNNER = {"iniconfig", "packaging", "pluggy", "pygments", "pytest"}


def _names(requirements: tuple[str, ...]) -> set[str]:
    return {spec.split("==")[0] for spec in requirements}


def _tiny_repo(root: Path) -> Path:
    """A repository needing tinydep, and tinyextra through its `tests` extra, which names
    the project's own `speedups` extra (PEP 621 self-reference)."""
    pyproject = """\
        [build-system]
        requires = ["setuptools>=61"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "tinyrepo"
        version = "0.1"
        dependencies = ["tinydep"]

        [project.optional-dependencies]
        speedups = ["tinyextra>=2"]
        tests = ["tinyrepo[speedups]"]

        [tool.setuptools]
        py-modules = ["tinyrepo"]
        """
    module = """\
        import tinydep
        import tinyextra


        def double_answer():
            return 2 * tinydep.ANSWER + tinyextra.BONUS
        """
    return _write(
        root / "tinyrepo",
        {"pyproject.toml": pyproject, "tinyrepo.py": module, "tests/test_tiny.py": TEST_MODULE},
    )


@pytest.fixture(scope="module")
def env_root() -> Iterator[Path]:
    """A world-traversable dest_root (the sandbox uid must reach the venv)."""
    path = make_shared_tempdir("cr-envs-test-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_repo(tmp_path_factory.mktemp("repos"))


@pytest.fixture(scope="module")
def env(tiny_repo: Path, env_root: Path, wheelhouse: Path) -> RepoEnvironment:
    return build_repo_environment(
        tiny_repo, env_root / "shared", wheelhouse=wheelhouse, offline=True
    )


def _python(env: RepoEnvironment, code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(env.python), "-c", code], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def test_environment_holds_the_test_needs_and_the_repository_metadata_but_not_its_code(
    env: RepoEnvironment, env_root: Path, tmp_path: Path, tiny_repo: Path
) -> None:
    assert _names(env.requirements) == {"tinydep", "tinyextra", *RUNNER}
    assert "tinydep==1.0" in env.requirements and "tinyextra==2.0" in env.requirements
    assert env.extra == "tests"
    assert env.group is None
    assert env.project == "tinyrepo==0.1"
    assert env.roots == (".",)
    assert env.note == ""
    assert env.root.parent == env_root / "shared"
    assert env.python == env.root / "bin" / "python"
    found = _python(
        env, "import tinydep, tinyextra; print(tinydep.ANSWER, tinyextra.BONUS)", tmp_path
    )
    assert found.stdout.strip() == "21 100"
    # the repository is a distribution of the environment (its metadata) ...
    own = _python(env, "import importlib.metadata as m; print(m.version('tinyrepo'))", tmp_path)
    assert own.stdout.strip() == "0.1", own.stderr
    # ... whose code is nowhere in it: outside a work tree there is nothing to import
    assert "ModuleNotFoundError" in _python(env, "import tinyrepo", tmp_path).stderr
    assert not list(site_packages(env.root).glob("tinyrepo.py"))
    # inside one, the work tree's code is imported, wherever the tree is
    copy = tmp_path / "elsewhere" / "tree"
    shutil.copytree(tiny_repo, copy)
    here = _python(env, "import tinyrepo; print(tinyrepo.__file__)", copy)
    assert here.stdout.strip() == str(copy / "tinyrepo.py"), here.stderr
    named = subprocess.run(
        [str(env.python), "-c", "import tinyrepo; print(tinyrepo.__file__)"],
        cwd=tmp_path,
        env={**os.environ, "COMPOSER_REPLICATION_WORKTREE": str(copy)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert named.stdout.strip() == str(copy / "tinyrepo.py"), named.stderr
    record = json.loads((env.root / MARKER).read_text())
    assert record["requirements"] == list(env.requirements)
    assert record["project"] == "tinyrepo==0.1"
    assert record["sources"] == ["extras tests"]


def test_environment_is_world_readable(env: RepoEnvironment) -> None:
    for dirpath, _dirnames, filenames in os.walk(env.root):
        assert os.stat(dirpath).st_mode & 0o777 == 0o755, dirpath
        for name in filenames:
            path = Path(dirpath) / name
            if not path.is_symlink():
                assert path.stat().st_mode & 0o444 == 0o444, path


def test_second_call_reuses_the_complete_environment(
    env: RepoEnvironment, tiny_repo: Path, env_root: Path, wheelhouse: Path
) -> None:
    lines: list[str] = []
    again = build_repo_environment(
        tiny_repo, env_root / "shared", wheelhouse=wheelhouse, offline=True, progress=lines.append
    )
    assert again == env
    assert lines == [f"reusing {env.root}"]
    assert [p.name for p in env.root.parent.iterdir()] == [env.root.name]  # no sibling built


def test_sandbox_kwargs_run_the_venv_interpreter_with_its_root_bound(env: RepoEnvironment) -> None:
    assert env.sandbox_kwargs() == {"python": str(env.python), "ro_binds": [str(env.root)]}


def test_without_a_pip_here_the_venv_bootstraps_its_own(
    tiny_repo: Path, env_root: Path, wheelhouse: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(virtualenv, "_host_pip", lambda: False)
    env = build_repo_environment(tiny_repo, env_root / "ensurepip", wheelhouse=wheelhouse)
    assert _names(env.requirements) == {"tinydep", "tinyextra", *RUNNER}
    # built in a temporary sibling, its scripts still name the final interpreter
    shebang = (env.root / "bin" / "pip").read_text().splitlines()[0]
    assert shebang == f"#!{env.root}/bin/python3"


def test_missing_dependency_fails_in_one_line_and_leaves_nothing(
    tmp_path: Path, env_root: Path, wheelhouse: Path
) -> None:
    repo = _write(
        tmp_path / "needy",
        {
            "pyproject.toml": '[project]\nname = "needy"\nversion = "1"\ndependencies = ["nosuchdep>=1"]\n'
        },
    )
    dest = env_root / "failures"
    with pytest.raises(RuntimeError) as info:
        build_repo_environment(repo, dest, wheelhouse=wheelhouse)
    message = str(info.value)
    assert "\n" not in message
    assert str(repo) in message
    assert "No matching distribution found for nosuchdep>=1" in message
    assert (
        f"put the missing distributions in the wheelhouse (pip download -d {wheelhouse}" in message
    )
    assert list(dest.iterdir()) == []  # the half-built venv is gone


def test_offline_needs_a_wheelhouse(tmp_path: Path, env_root: Path) -> None:
    with pytest.raises(ValueError, match=r"offline=True needs wheelhouse=DIR \(--wheelhouse DIR\)"):
        build_repo_environment(tmp_path, env_root, offline=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root hands runs to another uid")
def test_dest_root_the_sandbox_uid_cannot_reach_is_refused(tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(ValueError, match=r"is not reachable by the sandbox uid: .* drwx------"):
        build_repo_environment(tmp_path, private / "envs")
    assert not (private / "envs").exists()


BACKEND = """\
    import os
    import time
    import zipfile

    METADATA = (
        "Metadata-Version: 2.1\\nName: dynrepo\\nVersion: 0.1\\n"
        "Requires-Dist: tinydep\\nProvides-Extra: test\\n"
        "Requires-Dist: tinyextra; extra == 'test'\\n"
    )


    def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
        if os.environ.get("SLOW_BACKEND_PIDFILE"):
            with open(os.environ["SLOW_BACKEND_PIDFILE"], "w") as fh:
                fh.write(str(os.getpid()))
            time.sleep(60)
        name = "dynrepo-0.1-py3-none-any.whl"
        with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as zf:
            zf.writestr("dynrepo.py", open("dynrepo.py").read())
            zf.writestr("dynrepo-0.1.dist-info/METADATA", METADATA)
            zf.writestr(
                "dynrepo-0.1.dist-info/WHEEL",
                "Wheel-Version: 1.0\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n",
            )
            zf.writestr("dynrepo-0.1.dist-info/RECORD", "")
        return name
    """


def _dynamic_repo(root: Path) -> Path:
    """A repository whose dependencies only its (in-tree) build backend knows."""
    pyproject = """\
        [build-system]
        requires = []
        build-backend = "backend"
        backend-path = ["."]

        [project]
        name = "dynrepo"
        version = "0.1"
        dynamic = ["dependencies", "optional-dependencies"]
        """
    files = {"pyproject.toml": pyproject, "backend.py": BACKEND, "dynrepo.py": "VALUE = 1\n"}
    return _write(root / "dynrepo", files)


def test_dependencies_only_the_build_backend_knows_are_resolved_by_pip(
    tmp_path: Path, env_root: Path, wheelhouse: Path
) -> None:
    repo = _dynamic_repo(tmp_path)
    env = build_repo_environment(repo, env_root / "dynamic", wheelhouse=wheelhouse)
    assert _names(env.requirements) == {"tinydep", "tinyextra", *RUNNER}
    assert env.extra == "test"
    assert env.project == "dynrepo==0.1"
    own = _python(env, "import importlib.metadata as m; print(m.version('dynrepo'))", tmp_path)
    assert own.stdout.strip() == "0.1", own.stderr


def test_timeout_kills_pip_and_its_backend(
    tmp_path: Path, env_root: Path, wheelhouse: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = _dynamic_repo(tmp_path)
    pidfile = tmp_path / "backend.pid"
    monkeypatch.setenv("SLOW_BACKEND_PIDFILE", str(pidfile))  # offline drops PIP_* only
    dest = env_root / "timeouts"
    with pytest.raises(RuntimeError, match=r"pip: timed out after \d+ s; pass a larger timeout_s"):
        build_repo_environment(repo, dest, wheelhouse=wheelhouse, timeout_s=6)
    backend = int(pidfile.read_text())
    deadline = time.monotonic() + 5  # SIGKILL went to the whole process group
    while pid_alive(backend) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(backend)
    assert list(dest.iterdir()) == []


def test_a_failing_build_backend_leaves_the_repository_out_and_says_what_it_said(
    tmp_path: Path, env_root: Path, wheelhouse: Path
) -> None:
    repo = _dynamic_repo(tmp_path)
    backend = repo / "backend.py"
    backend.write_text(backend.read_text().replace("    name = ", "    1 / 0\n    name = ", 1))
    lines: list[str] = []
    env = build_repo_environment(
        repo, env_root / "broken", wheelhouse=wheelhouse, progress=lines.append
    )
    # the tests still get their runner; the repository is not installed, and the note says
    # why in one line: pip's step, the backend's last line, our fix
    assert _names(env.requirements) == RUNNER
    assert env.project is None
    assert "\n" not in env.note
    assert env.note.startswith(
        f"the repository is not installed: its build failed (cannot install the test "
        f"dependencies of {repo}: pip: "
    )
    assert ": ZeroDivisionError: division by zero; the repository's build backend" in env.note
    assert any(line.startswith("not installing dynrepo itself: ") for line in lines)


@pytest.mark.integration
def test_repository_tests_pass_in_the_sandbox_only_with_the_environment(
    env: RepoEnvironment, tiny_repo: Path, shared_dir: Path
) -> None:
    workdir = shared_dir / "tinyrepo"
    shutil.copytree(tiny_repo, workdir)
    node = "tests/test_tiny.py::test_uses_its_dependencies"

    with_env = LocalSubprocessSandbox(workdir, exec_timeout_s=120, **env.sandbox_kwargs())
    try:
        result = with_env.run_tests("python -m pytest -q", ())
    finally:
        with_env.close()
    assert result.infrastructure_error is None
    assert result.outcomes == {node: "passed"}, result.output[-2000:]

    default = LocalSubprocessSandbox(workdir, exec_timeout_s=120)
    try:
        result = default.run_tests("python -m pytest -q", ())
    finally:
        default.close()
    assert result.outcomes == {"tests/test_tiny.py": "error"}  # collection: no tinydep
    assert "ModuleNotFoundError: No module named 'tinydep'" in result.output


@pytest.mark.integration
def test_repository_without_a_package_gets_a_venv_with_the_runner_that_runs_its_tests(
    env_root: Path, shared_dir: Path, wheelhouse: Path
) -> None:
    # tool settings only (no package declared): nothing to build, only the test runner
    repo = _write(
        shared_dir / "plain",
        {
            "pyproject.toml": "[tool.ruff]\nline-length = 100\n",
            "plain.py": "def one():\n    return 1\n",
            "test_plain.py": "import plain\n\n\ndef test_one():\n    assert plain.one() == 1\n",
        },
    )
    lines: list[str] = []
    env = build_repo_environment(
        repo, env_root / "bare", wheelhouse=wheelhouse, progress=lines.append
    )
    assert _names(env.requirements) == RUNNER
    assert env.project is None and env.note == ""
    assert lines[:2] == [
        f"creating virtualenv {env.root}",
        "resolving the test dependencies of plain",
    ]
    assert lines[-1] == f"environment ready: {env.root}"
    sandbox = LocalSubprocessSandbox(repo, exec_timeout_s=120, **env.sandbox_kwargs())
    try:
        result = sandbox.run_tests("python -m pytest -q", ())
    finally:
        sandbox.close()
    assert result.outcomes == {"test_plain.py::test_one": "passed"}, result.output[-2000:]


PLUGIN = """\
import pytest


def pytest_addoption(parser):
    parser.addoption("--tiny-flag", action="store_true")


@pytest.fixture
def tiny(request):
    return request.config.getoption("--tiny-flag")
"""


@pytest.mark.integration
def test_the_plugins_a_repository_declares_load_in_the_sandbox_by_name(
    env_root: Path, shared_dir: Path, wheelhouse: Path
) -> None:
    house = shared_dir / "plugin-wheels"
    shutil.copytree(wheelhouse, house)
    pure_wheel(house, "tinyplug", "1.0", PLUGIN, entry_points="[pytest11]\ntiny = tinyplug\n")
    repo = _write(
        shared_dir / "plugged",
        {
            "pyproject.toml": '[build-system]\nrequires = ["setuptools"]\n'
            'build-backend = "setuptools.build_meta"\n'
            '[project]\nname = "plugged"\nversion = "1"\n'
            '[project.optional-dependencies]\ntest = ["tinyplug"]\n'
            '[tool.pytest.ini_options]\naddopts = "--tiny-flag"\n'
            "[tool.setuptools]\npy-modules = []\n",
            "tests/test_plugged.py": "def test_flag(tiny):\n    assert tiny is True\n",
        },
    )
    env = build_repo_environment(repo, env_root / "plugged", wheelhouse=house)
    assert env.pytest_plugins == ("tiny",)
    assert env.plugin_options() == ["-p", "tiny"]
    sandbox = LocalSubprocessSandbox(repo, exec_timeout_s=120, **env.sandbox_kwargs())
    try:
        loaded = sandbox.run_tests("python -m pytest -q -p tiny", ())
        bare = sandbox.run_tests("python -m pytest -q", ())  # autoloading stays off
    finally:
        sandbox.close()
    assert loaded.outcomes == {"tests/test_plugged.py::test_flag": "passed"}, loaded.output
    assert not bare.outcomes and "unrecognized arguments: --tiny-flag" in bare.output


VERSIONED_TEST = """\
import importlib.metadata

import pkgmeta
from pkgmeta._version import VERSION


def test_the_installed_metadata_and_the_work_tree_agree():
    assert importlib.metadata.version("pkgmeta") == "2.5.0" == VERSION == pkgmeta.version()
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="pkgmeta")
    assert script.load() is pkgmeta.version
"""


@pytest.mark.integration
def test_a_src_layout_repository_reads_its_metadata_from_a_copy_at_another_path(
    env_root: Path, shared_dir: Path, wheelhouse: Path
) -> None:
    # an sdist of a VCS-versioned project: PKG-INFO, no history, a version file the build
    # writes (as setuptools-scm's version_file does)
    backend = """\
        from setuptools import build_meta as _orig
        from setuptools.build_meta import *  # noqa: F403
        import os


        def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
            version = os.environ["SETUPTOOLS_SCM_PRETEND_VERSION"]
            with open("src/pkgmeta/_version.py", "w") as fh:
                fh.write(f"VERSION = {version!r}\\n")
            return _orig.build_wheel(wheel_directory, config_settings, metadata_directory)
        """
    repo = _write(
        shared_dir / "pkgmeta-2.5.0",
        {
            "PKG-INFO": "Metadata-Version: 2.1\nName: pkgmeta\nVersion: 2.5.0\n",
            "pyproject.toml": '[build-system]\nrequires = ["setuptools"]\n'
            'build-backend = "scmlike"\nbackend-path = ["."]\n'
            '[project]\nname = "pkgmeta"\nversion = "2.5.0"\n'
            '[project.scripts]\npkgmeta = "pkgmeta:version"\n',
            "scmlike.py": backend,
            "src/pkgmeta/__init__.py": "import importlib.metadata\n\n\n"
            "def version():\n    return importlib.metadata.version('pkgmeta')\n",
            "tests/test_meta.py": VERSIONED_TEST,
        },
    )
    env = build_repo_environment(repo, env_root / "pkgmeta", wheelhouse=wheelhouse)
    assert env.project == "pkgmeta==2.5.0" and env.roots == ("src",)
    assert env.generated == ("src/pkgmeta/_version.py",)
    assert not (repo / "src" / "pkgmeta" / "_version.py").exists()  # the build ran on a copy
    workdir = shared_dir / "elsewhere" / "task-copy"
    shutil.copytree(repo, workdir)
    assert env.add_generated(workdir) == ["src/pkgmeta/_version.py"]
    sandbox = LocalSubprocessSandbox(workdir, exec_timeout_s=120, **env.sandbox_kwargs())
    try:
        result = sandbox.run_tests("python -m pytest -q -o pythonpath=src", ())
    finally:
        sandbox.close()
    node = "tests/test_meta.py::test_the_installed_metadata_and_the_work_tree_agree"
    assert result.outcomes == {node: "passed"}, result.output[-2000:]


RUNNER_IMPORTS_IT = """\
import sys

import iniconfig


def test_pytest_and_the_test_use_the_work_trees_iniconfig():
    assert iniconfig.MARK == "work tree"
    assert sys.modules["iniconfig"] is iniconfig
"""


@pytest.mark.integration
def test_a_package_the_test_runner_imports_is_tested_from_the_work_tree(
    env_root: Path, shared_dir: Path, wheelhouse: Path
) -> None:
    # pytest imports iniconfig before any test: a repository that IS iniconfig must be the
    # copy pytest itself runs with, or a change to it could never fail a test
    import iniconfig

    source = Path(iniconfig.__file__).parent
    repo = shared_dir / "iniconfig-repo"
    shutil.copytree(
        source, repo / "src" / "iniconfig", ignore=shutil.ignore_patterns("__pycache__")
    )
    with open(repo / "src" / "iniconfig" / "__init__.py", "a") as fh:
        fh.write('\nMARK = "work tree"\n')
    _write(
        repo,
        {
            "pyproject.toml": '[build-system]\nrequires = ["setuptools"]\n'
            'build-backend = "setuptools.build_meta"\n'
            '[project]\nname = "iniconfig"\nversion = "99.0"\n'
            '[tool.setuptools.packages.find]\nwhere = ["src"]\n',
            "testing/test_runner.py": RUNNER_IMPORTS_IT,
        },
    )
    env = build_repo_environment(repo, env_root / "iniconfig", wheelhouse=wheelhouse)
    assert env.project == "iniconfig==99.0"
    assert "iniconfig" not in _names(env.requirements)  # no released copy beside it
    assert not list(site_packages(env.root).glob("iniconfig/__init__.py"))
    workdir = shared_dir / "iniconfig-task"
    shutil.copytree(repo, workdir)
    sandbox = LocalSubprocessSandbox(workdir, exec_timeout_s=120, **env.sandbox_kwargs())
    try:
        result = sandbox.run_tests("python -m pytest -q testing", ())
        (workdir / "src" / "iniconfig" / "__init__.py").write_text("raise ImportError('broken')\n")
        broken = sandbox.run_tests("python -m pytest -q testing", ())
    finally:
        sandbox.close()
    node = "testing/test_runner.py::test_pytest_and_the_test_use_the_work_trees_iniconfig"
    assert result.outcomes == {node: "passed"}, result.output[-2000:]
    assert broken.outcomes.get(node) != "passed"  # the runner itself sees the change
    assert "broken" in broken.output
