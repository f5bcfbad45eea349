"""DockerSandbox: the lockdown arguments and error paths without a daemon; the real thing
when a Docker daemon answers (skipped otherwise)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from composer_replication.sandbox import Sandbox
from composer_replication.sandbox.docker import (
    LABEL,
    DockerSandbox,
    reap_leaked,
    runsc_available,
)

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
        "volumes": {str(tmp_path.resolve()): {"bind": "/work", "mode": "rw"}},
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
