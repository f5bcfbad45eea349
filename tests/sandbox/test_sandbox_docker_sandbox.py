"""DockerSandbox: the lockdown arguments and error paths without a daemon; guarded test runs
end to end through a bubblewrap stand-in for the daemon (``bwrap_docker``); the real thing
when a Docker daemon answers (skipped otherwise)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from bwrap_docker import BwrapDockerClient, bwrap_available

from composer_replication.sandbox import Sandbox
from composer_replication.sandbox.base import GuardSpec
from composer_replication.sandbox.behaviour_guard import GUARD_ENV
from composer_replication.sandbox.docker import (
    GUARD_MOUNT,
    LABEL,
    DockerSandbox,
    reap_leaked,
    runsc_available,
)
from composer_replication.sandbox.pytest_support import (
    guard_site_dir,
    pytest_bundle_dir,
    support_root,
)
from composer_replication.sandbox.workdir import make_shared_tempdir

TEST_IMAGE = os.environ.get("CR_DOCKER_TEST_IMAGE", "python:3.11-slim")


def _daemon_client():
    try:
        import docker

        client = docker.from_env()
        client.ping()
        return client
    except Exception:
        return None


CLIENT = _daemon_client()
needs_daemon = pytest.mark.skipif(CLIENT is None, reason="no Docker daemon answers ping()")
needs_no_daemon = pytest.mark.skipif(CLIENT is not None, reason="a Docker daemon is running")


def test_container_kwargs_carry_the_whole_lockdown(tmp_path: Path) -> None:
    sandbox = DockerSandbox(tmp_path, runtime="runsc", pids_limit=64, tmpfs_size="32m")
    assert sandbox.container_kwargs("python:3.11-slim") == {
        "image": "python:3.11-slim",
        "command": ["tail", "-f", "/dev/null"],
        "detach": True,
        "network_mode": "none",
        "read_only": True,
        "tmpfs": {"/tmp": "rw,nosuid,nodev,size=32m"},
        "volumes": {
            str(tmp_path.resolve()): {"bind": "/work", "mode": "rw"},
            # the behaviour guard, where no sandbox command can replace it
            str(guard_site_dir()): {"bind": "/opt/composer-replication-guard", "mode": "ro"},
        },
        "working_dir": "/work",
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "user": "1000:1000",
        "pids_limit": 64,
        "mem_limit": "1g",
        "memswap_limit": "1g",
        "nano_cpus": 2_000_000_000,
        "labels": {"composer_replication": "datagen"},
        "environment": {
            "HOME": "/tmp",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
            "MALLOC_ARENA_MAX": "2",
            "COMPOSER_REPLICATION_WORKTREE": "/work",
        },
        "init": True,
        "ipc_mode": "private",
        "runtime": "runsc",
    }
    assert LABEL == {"composer_replication": "datagen"}


def test_defaults_match_the_spec_and_root_writable_is_opt_in(tmp_path: Path) -> None:
    sandbox = DockerSandbox(tmp_path, keep_root_writable=True)
    kwargs = sandbox.container_kwargs("img")
    assert kwargs["read_only"] is False and "runtime" not in kwargs
    assert (sandbox.exec_timeout_s, sandbox.container_workdir, sandbox.user) == (
        600,
        "/work",
        "1000:1000",
    )
    assert isinstance(sandbox, Sandbox)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"user": "0:0"}, "non-root"),
        ({"user": "root"}, "non-root"),
        ({"container_workdir": "work"}, "must be absolute"),
        ({"pids_limit": 0}, "must be > 0"),
    ],
)
def test_invalid_settings_are_refused(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DockerSandbox(tmp_path, **kwargs)


def test_denied_command_needs_no_container(tmp_path: Path) -> None:
    sandbox = DockerSandbox(tmp_path)
    assert sandbox.exec({"command": "curl http://x"}) == (
        "command not allowed: 'curl' is in SANDBOX_DENYLIST"
    )
    assert sandbox.trajectory()[0]["allowed"] is False


def test_exec_before_boot_says_what_to_do(tmp_path: Path) -> None:
    with DockerSandbox(tmp_path) as sandbox, pytest.raises(RuntimeError, match=r"boot\(image\)"):
        sandbox.exec({"command": "ls"})


def test_missing_sdk_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "docker", None)  # makes `import docker` fail
    with pytest.raises(RuntimeError, match=r"pip install 'composer-replication\[docker\]'"):
        reap_leaked()
    with pytest.raises(RuntimeError, match="docker SDK"):
        DockerSandbox(tmp_path).boot("python:3.11-slim")


@needs_no_daemon
def test_no_daemon_is_a_clear_error(tmp_path: Path) -> None:
    for call in (reap_leaked, runsc_available, lambda: DockerSandbox(tmp_path).boot("img")):
        with pytest.raises(RuntimeError, match="no Docker daemon reachable"):
            call()


@needs_daemon
@pytest.mark.integration
@pytest.mark.slow
def test_container_is_locked_down(tmp_path: Path) -> None:
    if not CLIENT.images.list(name=TEST_IMAGE):
        pytest.skip(f"image {TEST_IMAGE} not present locally (set CR_DOCKER_TEST_IMAGE)")
    os.chmod(tmp_path, 0o777)
    with DockerSandbox(tmp_path, exec_timeout_s=20) as sandbox:
        sandbox.boot(TEST_IMAGE)
        assert sandbox.exec({"command": "id -u"}).strip() == "1000"
        assert "Read-only file system" in sandbox.exec({"command": "touch /etc/x"})
        net = sandbox.exec(
            {"command": "python -c \"import socket; socket.create_connection(('1.1.1.1', 53), 2)\""}
        )
        assert "Errno" in net or "unreachable" in net
        sandbox.exec({"command": "echo hi > made.txt"})
        assert (tmp_path / "made.txt").read_text() == "hi\n"
        assert reap_leaked(CLIENT) >= 1


# --- the behaviour guard in the container ------------------------------------------------
SPEC = GuardSpec(protected=("tests/test_calc.py",), candidates=("calc.py",))


def test_a_guarded_run_loads_the_guard_from_its_read_only_mount(tmp_path: Path) -> None:
    sandbox = DockerSandbox(tmp_path, container_workdir="/src")
    argv, environment = sandbox.guarded_run(["python", "-m", "pytest", "-q"], SPEC)
    # a shell puts the guard first, keeping what the image set, then becomes the runner
    assert argv[:2] == ["sh", "-c"] and argv[3:] == [
        "sh",
        GUARD_MOUNT,
        "sitecustomize",
        "python",
        "-m",
        "pytest",
        "-q",
    ]
    assert 'PYTHONPATH="$1${PYTHONPATH:+:$PYTHONPATH}"' in argv[2]
    assert 'PYTEST_PLUGINS="$2${PYTEST_PLUGINS:+,$PYTEST_PLUGINS}"' in argv[2]
    assert argv[2].endswith('exec "$@"')
    assert json.loads(environment.pop(GUARD_ENV)) == {
        "root": "/src",
        "protected": ["tests/test_calc.py"],
        "candidates": ["calc.py"],
        "report_prefix": ".cr-junit-",
    }
    assert environment == {}
    assert DockerSandbox.supports_behaviour_guard is True
    assert (guard_site_dir() / "sitecustomize.py").is_file()


TESTS = "from calc import add\n\ndef test_add():\n    assert add(1, 2) == 3\n"
HONEST = "def add(a, b):\n    return a + b\n"
# pytest patched from the code under test: every test reported passed, exit code 0
FORGES_A_PASS = (
    "import _pytest.runner as _r\n_orig = _r.call_and_report\n"
    "def _forged(item, when, log=True, **kw):\n"
    "    rep = _orig(item, when, log=False, **kw)\n"
    "    rep.outcome, rep.longrepr = 'passed', None\n"
    "    if log:\n        item.ihook.pytest_runtest_logreport(report=rep)\n"
    "    return rep\n"
    "_r.call_and_report = _forged\n\ndef add(a, b):\n    return 0\n"
)
READS_THE_TESTS = "_src = open('tests/test_calc.py').read()\n\n" + HONEST


@pytest.fixture
def standin_workdir():
    root = make_shared_tempdir("cr-docker-guard-")
    (root / "tests").mkdir()
    (root / "tests" / "test_calc.py").write_text(TESTS)
    yield root
    import shutil

    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.integration
@pytest.mark.skipif(not bwrap_available(), reason="the daemon stand-in needs bubblewrap")
def test_the_guard_runs_in_the_container_end_to_end(standin_workdir: Path) -> None:
    # the "image": the host's /usr/bin/python3 with pytest on the image's own PYTHONPATH,
    # which the guarded command keeps behind the guard's directory
    bundle = str(pytest_bundle_dir())
    client = BwrapDockerClient(image_env={"PYTHONPATH": bundle}, image_binds=[str(support_root())])
    calc = standin_workdir / "calc.py"

    def run(code: str, guard: GuardSpec | None):
        calc.write_text(code)
        with DockerSandbox(standin_workdir, client=client, python="python3") as sandbox:
            sandbox.boot("stand-in")
            return sandbox.run_tests("python -m pytest -q", (), guard=guard)

    honest = run(HONEST, SPEC)
    assert honest.ok and honest.passed == 1 and honest.behaviour_flags == ()
    # the forged pass is real without the guard, and caught with it
    assert run(FORGES_A_PASS, None).ok
    forged = run(FORGES_A_PASS, SPEC)
    assert forged.behaviour_flags == (
        "pytest_tampered: _pytest.runner.call_and_report was replaced",
    )
    assert (forged.passed, forged.errors) == (0, 1) and not forged.ok
    reads = run(READS_THE_TESTS, SPEC)
    assert reads.behaviour_flags == ("tests_read: code under test read tests/test_calc.py",)
    assert not reads.ok
    # the guard's directory is read-only in the container, whoever runs there
    with DockerSandbox(standin_workdir, client=client, python="python3") as sandbox:
        sandbox.boot("stand-in")
        out = sandbox.exec({"command": f"echo x > {GUARD_MOUNT}/sitecustomize.py"})
        assert "Read-only file system" in out
    # an image whose Python cannot run the guard is an error, never an unguarded run
    with DockerSandbox(standin_workdir, client=client, python="/bin/false") as sandbox:
        sandbox.boot("stand-in")
        with pytest.raises(RuntimeError, match=r"needs audit hooks \(Python 3.8 or newer\)"):
            sandbox.run_tests("python -m pytest -q", (), guard=SPEC)
        assert [e["type"] for e in sandbox.trajectory()] == ["boot"]
