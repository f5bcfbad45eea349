"""DockerSandbox's seed controls without a daemon (an injected fake client), and for real when a
Docker daemon answers: the workdir is scrubbed before the container starts, a crashed run's
containers are reaped (never a live process's), close() never raises, and a run config picks
the Docker backend for the built-in environments."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import docker.errors
import pytest
import requests

from composer_replication.config.run import EnvConfig, RunConfig
from composer_replication.envs import build_environment
from composer_replication.envs import feature_deletion as fd_env
from composer_replication.envs import python_functions as pf_env
from composer_replication.envs.function_grader import MAX_REPORT_BYTES
from composer_replication.sandbox.docker import (
    LABEL,
    OWNER_HOST_LABEL,
    OWNER_PID_LABEL,
    OWNER_START_LABEL,
    DockerSandbox,
    DockerSandboxFactory,
    owner_labels,
    reap_leaked,
)

# --- a scripted docker client ----------------------------------------------------------------


class FakeContainer:
    def __init__(self, client: FakeClient, cid: str, labels: dict, state: str, name: str) -> None:
        self.client, self.id, self.name = client, cid, name
        self.attrs = {"Id": cid, "Labels": dict(labels), "State": state, "Names": [f"/{name}"]}
        self.remove_error: BaseException | None = None
        self.remove_calls = 0

    def remove(self, force: bool = False) -> None:
        self.remove_calls += 1
        assert force is True
        if self.remove_error is not None:
            raise self.remove_error
        if self.id not in self.client.by_id:
            raise docker.errors.NotFound(f"No such container: {self.id}")
        del self.client.by_id[self.id]
        self.client.removed.append(self.id)


class FakeContainers:
    def __init__(self, client: FakeClient) -> None:
        self.client = client
        self.list_calls: list[dict] = []
        self.run_calls: list[dict] = []
        self.list_error: BaseException | None = None
        self.run_error: BaseException | None = None
        self.create_before_error = False

    def list(self, **kwargs: Any) -> list[FakeContainer]:
        self.list_calls.append(kwargs)
        if self.list_error is not None:
            raise self.list_error
        key, _, value = kwargs["filters"]["label"].partition("=")
        return [c for c in self.client.by_id.values() if c.attrs["Labels"].get(key) == value]

    def run(self, **kwargs: Any) -> FakeContainer:
        workdir = next(iter(kwargs["volumes"]))
        # what the container would see at start
        kwargs["_tree_at_start"] = sorted(
            str(p.relative_to(workdir)) for p in Path(workdir).rglob("*")
        )
        self.run_calls.append(kwargs)
        if self.run_error is not None:
            if self.create_before_error:  # created, then failed to start
                self.client.add(kwargs["labels"], "created", name=kwargs["name"])
            raise self.run_error
        return self.client.add(kwargs["labels"], "running", name=kwargs["name"])

    def get(self, name: str) -> FakeContainer:
        for c in self.client.by_id.values():
            if name in (c.id, c.name):
                return c
        raise docker.errors.NotFound(f"No such container: {name}")


class FakeClient:
    def __init__(self) -> None:
        self.by_id: dict[str, FakeContainer] = {}
        self.removed: list[str] = []
        self.containers = FakeContainers(self)

    def add(self, labels: dict, state: str, *, name: str | None = None) -> FakeContainer:
        cid = f"c{len(self.by_id) + len(self.removed):03d}"
        container = FakeContainer(self, cid, labels, state, name or cid)
        self.by_id[cid] = container
        return container


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _owned(pid: int, *, host: str | None = None, start: str | None = None) -> dict[str, str]:
    labels = {**LABEL, OWNER_HOST_LABEL: host or socket.gethostname(), OWNER_PID_LABEL: str(pid)}
    if start is not None:
        labels[OWNER_START_LABEL] = start
    return labels


@pytest.fixture
def client() -> FakeClient:
    return FakeClient()


# --- boot scrubs the workdir before the container starts -------------------------------------


def _leaky_workdir(root: Path) -> Path:
    (root / ".git" / "refs").mkdir(parents=True)
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\x00")
    (root / "pkg" / "mod.py").write_text("def f():\n    raise NotImplementedError\n")
    (root / "pkg" / "mod.py.orig").write_text("def f():\n    return 42\n")
    (root / "tests").mkdir()
    (root / "tests" / "test_mod.py").write_text("def test_f(): ...\n")
    return root


def test_boot_scrubs_leaks_before_the_container_starts(tmp_path: Path, client: FakeClient) -> None:
    workdir = _leaky_workdir(tmp_path)
    sandbox = DockerSandbox(workdir, client=client)
    sandbox.boot("python:3.11-slim")
    (call,) = client.containers.run_calls
    assert call["_tree_at_start"] == ["pkg", "pkg/mod.py", "tests", "tests/test_mod.py"]
    boot = sandbox.trajectory()[0]
    assert boot["type"] == "boot" and boot["image"] == "python:3.11-slim"
    assert boot["scrubbed"] == [".git", "pkg/__pycache__", "pkg/mod.py.orig"]


def test_scrub_can_be_switched_off_for_a_directory_without_references(
    tmp_path: Path, client: FakeClient
) -> None:
    workdir = _leaky_workdir(tmp_path)
    sandbox = DockerSandbox(workdir, client=client, scrub_workdir=False)
    sandbox.boot("img")
    assert ".git/HEAD" in client.containers.run_calls[0]["_tree_at_start"]
    assert sandbox.trajectory()[0]["scrubbed"] == []


def test_boot_adds_name_and_owner_labels_on_top_of_the_lockdown(
    tmp_path: Path, client: FakeClient
) -> None:
    sandbox = DockerSandbox(tmp_path, client=client, runtime="runsc")
    sandbox.boot("img")
    call = dict(client.containers.run_calls[0])
    call.pop("_tree_at_start")
    name, labels = call.pop("name"), call.pop("labels")
    lockdown = sandbox.container_kwargs("img")
    assert lockdown.pop("labels") == LABEL
    assert call == lockdown  # nothing of the lockdown is lost or changed
    assert name.startswith("cr-sandbox-") and len(name) == len("cr-sandbox-") + 16
    assert labels == {**LABEL, **owner_labels()}
    assert labels[OWNER_HOST_LABEL] == socket.gethostname()
    assert labels[OWNER_PID_LABEL] == str(os.getpid())
    if Path("/proc/self/stat").exists():
        assert labels[OWNER_START_LABEL].count("/") == 1


def test_a_second_sandbox_gets_a_different_container_name(
    tmp_path: Path, client: FakeClient
) -> None:
    for _ in range(2):
        DockerSandbox(tmp_path, client=client).boot("img")
    names = [c["name"] for c in client.containers.run_calls]
    assert len(set(names)) == 2


# --- reaping: a crashed run's leftovers only -----------------------------------------------


def _population(client: FakeClient) -> dict[str, FakeContainer]:
    me = os.getpid()
    live_other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = _dead_pid()
    my_start = owner_labels().get(OWNER_START_LABEL)
    containers = {
        "crashed_running": client.add(_owned(dead), "running"),
        "crashed_created": client.add(_owned(dead), "created"),
        "mine_running": client.add(_owned(me, start=my_start), "running"),
        "mine_exited": client.add(_owned(me, start=my_start), "exited"),
        "live_other_process": client.add(_owned(live_other.pid), "running"),
        "other_host": client.add(_owned(dead, host="some-other-host"), "exited"),
        "unowned_exited": client.add(dict(LABEL), "exited"),
        "unowned_dead": client.add(dict(LABEL), "dead"),
        "unowned_running": client.add(dict(LABEL), "running"),
        "unowned_created": client.add(dict(LABEL), "created"),
        "not_ours": client.add({"other.project": "x"}, "exited"),
    }
    if my_start is not None:  # same pid, another process start: the pid was reused
        containers["reused_pid"] = client.add(_owned(me, start="old-boot/1"), "running")
    client._live_other = live_other  # type: ignore[attr-defined]
    return containers


STALE = {"crashed_running", "crashed_created", "unowned_exited", "unowned_dead", "reused_pid"}


def test_stale_only_reaping_keeps_live_owners_and_other_hosts(client: FakeClient) -> None:
    containers = _population(client)
    try:
        removed = reap_leaked(client, stale_only=True)
    finally:
        client._live_other.kill()  # type: ignore[attr-defined]
        client._live_other.wait()  # type: ignore[attr-defined]
    expected = {containers[k].id for k in STALE if k in containers}
    assert removed == len(expected)
    assert set(client.removed) == expected
    (call,) = client.containers.list_calls
    assert call["all"] is True and call["filters"] == {"label": "composer_replication=datagen"}


def test_full_reap_removes_every_labelled_container(client: FakeClient) -> None:
    containers = _population(client)
    client._live_other.kill()  # type: ignore[attr-defined]
    client._live_other.wait()  # type: ignore[attr-defined]
    assert reap_leaked(client) == len(containers) - 1
    assert set(client.by_id) == {containers["not_ours"].id}


def test_boot_reaps_stale_containers_first(tmp_path: Path, client: FakeClient) -> None:
    containers = _population(client)
    try:
        DockerSandbox(tmp_path, client=client).boot("img")
    finally:
        client._live_other.kill()  # type: ignore[attr-defined]
        client._live_other.wait()  # type: ignore[attr-defined]
    assert set(client.removed) == {containers[k].id for k in STALE if k in containers}
    assert client.containers.run_calls  # and the sandbox still booted
    # the other process has ended since: its container is stale now; ours (live) is kept
    new = client.containers.run_calls[0]["name"]
    assert reap_leaked(client, stale_only=True) == 1
    assert client.removed[-1] == containers["live_other_process"].id
    assert new in {c.name for c in client.by_id.values()}


def test_reaping_can_be_switched_off(tmp_path: Path, client: FakeClient) -> None:
    stale = client.add(_owned(_dead_pid()), "running")
    DockerSandbox(tmp_path, client=client, reap_stale=False).boot("img")
    assert client.containers.list_calls == []
    assert stale.id in client.by_id


def test_a_failing_reap_never_fails_the_boot(
    tmp_path: Path, client: FakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    client.containers.list_error = docker.errors.APIError("daemon hiccup")
    with caplog.at_level(logging.WARNING, logger="composer_replication.sandbox.docker"):
        sandbox = DockerSandbox(tmp_path, client=client)
        sandbox.boot("img")
    assert len(client.containers.run_calls) == 1
    assert "could not reap stale sandbox containers" in caplog.text
    assert "daemon hiccup" in caplog.text
    sandbox.close()


def test_a_container_that_cannot_be_removed_is_skipped_not_counted(
    client: FakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    dead = _dead_pid()
    busy = client.add(_owned(dead), "running")
    busy.remove_error = docker.errors.APIError("removal already in progress")
    gone = client.add(_owned(dead), "exited")
    gone.remove_error = docker.errors.NotFound("No such container")
    other = client.add(_owned(dead), "exited")
    with caplog.at_level(logging.WARNING, logger="composer_replication.sandbox.docker"):
        assert reap_leaked(client, stale_only=True) == 1
    assert client.removed == [other.id]
    assert "removal already in progress" in caplog.text


# --- close() never raises -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        docker.errors.NotFound("No such container"),
        docker.errors.APIError("removal of container is already in progress"),
        requests.exceptions.ConnectionError("daemon gone"),
        docker.errors.DockerException("Error while fetching server API version"),
        RuntimeError("anything else"),
    ],
    ids=["not-found", "conflict", "daemon-gone", "docker-exception", "runtime-error"],
)
def test_close_never_raises(tmp_path: Path, client: FakeClient, error: Exception) -> None:
    sandbox = DockerSandbox(tmp_path, client=client)
    sandbox.boot("img")
    container = next(iter(client.by_id.values()))
    container.remove_error = error
    assert sandbox.close() is None
    assert sandbox.close() is None  # idempotent: the container is forgotten after one try
    assert container.remove_calls == 1
    with pytest.raises(RuntimeError, match=r"boot\(image\)"):
        sandbox.exec({"command": "ls"})  # closed means not booted


def test_close_logs_what_it_swallowed(
    tmp_path: Path, client: FakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    sandbox = DockerSandbox(tmp_path, client=client)
    sandbox.boot("img")
    next(iter(client.by_id.values())).remove_error = requests.exceptions.ConnectionError("gone")
    with caplog.at_level(logging.DEBUG, logger="composer_replication.sandbox.docker"):
        sandbox.close()
    assert "could not remove sandbox container" in caplog.text
    assert "ConnectionError" in caplog.text


def test_close_after_an_external_removal_and_on_a_never_booted_sandbox(
    tmp_path: Path, client: FakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    DockerSandbox(tmp_path, client=client).close()  # never booted: nothing to do
    sandbox = DockerSandbox(tmp_path, client=client)
    sandbox.boot("img")
    assert reap_leaked(client) == 1  # someone removed it behind our back
    with caplog.at_level(logging.DEBUG, logger="composer_replication.sandbox.docker"):
        sandbox.close()  # NotFound: swallowed, and not worth a warning
    assert "already removed" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_context_exit_does_not_mask_the_real_error(tmp_path: Path, client: FakeClient) -> None:
    with (
        pytest.raises(ValueError, match="the real error"),
        DockerSandbox(tmp_path, client=client) as sandbox,
    ):
        sandbox.boot("img")
        next(iter(client.by_id.values())).remove_error = docker.errors.APIError("boom")
        raise ValueError("the real error")


def test_a_container_created_but_not_started_is_removed(tmp_path: Path, client: FakeClient) -> None:
    client.containers.run_error = docker.errors.APIError("unknown runtime: runsc")
    client.containers.create_before_error = True
    sandbox = DockerSandbox(tmp_path, client=client, runtime="runsc")
    with pytest.raises(docker.errors.APIError, match="unknown runtime"):
        sandbox.boot("img")
    assert client.by_id == {} and len(client.removed) == 1
    client.containers.run_error = None
    sandbox.boot("img")  # not left half-booted
    assert len(client.by_id) == 1


def test_missing_image_says_how_to_get_it(tmp_path: Path, client: FakeClient) -> None:
    client.containers.run_error = docker.errors.ImageNotFound("no such image")
    with pytest.raises(RuntimeError, match=r"docker pull python:3\.11-slim"):
        DockerSandbox(tmp_path, client=client).boot("python:3.11-slim")


# --- the factory environments use ---------------------------------------------------------------


def test_factory_builds_booted_sandboxes_with_its_settings(
    tmp_path: Path, client: FakeClient
) -> None:
    factory = DockerSandboxFactory(
        "python:3.11-slim", client=client, runtime="runsc", pids_limit=64, exec_timeout_s=30
    )
    sandbox = factory(_leaky_workdir(tmp_path))
    assert isinstance(sandbox, DockerSandbox)
    assert (sandbox.runtime, sandbox.pids_limit, sandbox.exec_timeout_s) == ("runsc", 64, 30.0)
    call = client.containers.run_calls[0]
    assert (call["image"], call["runtime"], call["pids_limit"]) == ("python:3.11-slim", "runsc", 64)
    assert ".git" not in call["_tree_at_start"]
    assert sandbox.trajectory()[0]["type"] == "boot"
    sandbox.close()
    assert client.by_id == {}


def test_factory_closes_a_sandbox_whose_boot_failed(tmp_path: Path, client: FakeClient) -> None:
    client.containers.run_error = docker.errors.ImageNotFound("no such image")
    with pytest.raises(RuntimeError, match="not found"):
        DockerSandboxFactory("img", client=client)(tmp_path)
    assert client.by_id == {}


@pytest.mark.parametrize(
    ("image", "settings", "match"),
    [
        ("", {}, "needs an image name"),
        ("img", {"memory": "1g"}, r"unknown DockerSandbox setting\(s\) \['memory'\]"),
        ("img", {"user": "0:0"}, "non-root"),
        ("img", {"pids_limit": 0}, "must be > 0"),
        ("img", {"container_workdir": "work"}, "must be absolute"),
    ],
)
def test_factory_checks_settings_when_built(image: str, settings: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DockerSandboxFactory(image, **settings)


# --- a run config selects the backend ----------------------------------------------------------


def _fd_task_file(root: Path) -> Path:
    workdir = root / "tasks.workdirs" / "t0"
    (workdir / "pkg").mkdir(parents=True)
    (workdir / "pkg" / "m.py").write_text("def f():\n    raise NotImplementedError\n")
    record = {
        "task_id": "fd:r:pkg/m.py:f",
        "repo": "r",
        "file": "pkg/m.py",
        "qualname": "f",
        "target_tests": ["tests/test_m.py::test_f"],
        "passing_tests": ["tests/test_m.py::test_f"],
        "prompt": "Restore f.",
        "files": ["pkg/m.py"],
        "workdir": str(workdir),
        "test_command": "python -m pytest -q",
        "split": "train",
    }
    task_file = root / "tasks.jsonl"
    task_file.write_text(json.dumps(record) + "\n")
    return task_file


def test_python_functions_env_gets_the_factory_the_config_selects() -> None:
    local = build_environment(EnvConfig(name="python_functions"))
    assert local.sandbox_factory is pf_env.default_sandbox_factory
    env = build_environment(
        EnvConfig(
            name="python_functions",
            sandbox="docker",
            docker={"image": "python:3.11-slim", "runtime": "runsc", "pids_limit": 64},
        )
    )
    factory = env.sandbox_factory
    assert isinstance(factory, DockerSandboxFactory)
    assert factory.image == "python:3.11-slim"
    assert factory.settings == {
        "runtime": "runsc",
        "mem_limit": "1g",
        "memswap_limit": "1g",
        "pids_limit": 64,
        "nano_cpus": 2_000_000_000,
        "user": "1000:1000",
        "tmpfs_size": "64m",
        "exec_timeout_s": 20,  # the environment's own limit, as with the local sandbox
        "max_output_bytes": MAX_REPORT_BYTES,
    }


def test_feature_deletion_env_gets_the_factory_the_config_selects(tmp_path: Path) -> None:
    task_file = _fd_task_file(tmp_path)
    local = build_environment(EnvConfig(name="feature_deletion", options={"task_file": task_file}))
    assert local.sandbox_factory is fd_env.default_sandbox_factory
    env = build_environment(
        EnvConfig(
            name="feature_deletion",
            options={"task_file": str(task_file)},
            sandbox="docker",
            docker={"image": "repo-image:1", "exec_timeout_s": 90, "mem_limit": "2g"},
        )
    )
    factory = env.sandbox_factory
    assert isinstance(factory, DockerSandboxFactory) and factory.image == "repo-image:1"
    assert factory.settings["exec_timeout_s"] == 90
    assert (factory.settings["mem_limit"], factory.settings["memswap_limit"]) == ("2g", "2g")
    # a task made with a virtualenv on this host names an interpreter no image holds
    with pytest.raises(ValueError, match="virtualenv on this host"):
        factory(tmp_path, python="/opt/venv/bin/python")


def test_a_toml_run_config_selects_docker_per_environment(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        "[[envs]]\n"
        'name = "python_functions"\n'
        'sandbox = "docker"\n'
        "[envs.docker]\n"
        'image = "python:3.11-slim"\n'
        'memswap_limit = "2g"\n'
    )
    (env_config,) = RunConfig.from_toml(path).envs
    assert env_config.sandbox == "docker" and env_config.docker.image == "python:3.11-slim"
    factory = build_environment(env_config).sandbox_factory
    assert isinstance(factory, DockerSandboxFactory)
    assert (factory.settings["mem_limit"], factory.settings["memswap_limit"]) == ("1g", "2g")
    assert RunConfig().envs[0].sandbox == "local" and RunConfig().envs[0].docker is None


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"sandbox": "docker"}, r"needs an \[envs.docker\] table naming the image"),
        ({"sandbox": "podman"}, "Input should be 'local' or 'docker'"),
        ({"docker": {"image": "img"}}, "set sandbox = 'docker' to use it"),
        ({"sandbox": "docker", "docker": {}}, r"docker.image\n  Field required"),
        ({"sandbox": "docker", "docker": {"image": ""}}, "at least 1 character"),
        ({"sandbox": "docker", "docker": {"image": "i", "user": "root"}}, "as root"),
        ({"sandbox": "docker", "docker": {"image": "i", "mem_limit": "lots"}}, "pattern"),
        ({"sandbox": "docker", "docker": {"image": "i", "exec_timeout_s": 0}}, "greater than 0"),
        ({"sandbox": "docker", "docker": {"image": "i", "cpus": 2}}, "Extra inputs"),
        (
            {"name": "my_pkg.envs:make", "sandbox": "docker", "docker": {"image": "i"}},
            "an environment factory builds its own sandboxes",
        ),
    ],
)
def test_bad_sandbox_settings_are_clear_config_errors(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EnvConfig(**fields)


def test_docker_backend_and_an_explicit_factory_option_conflict() -> None:
    config = EnvConfig(
        name="python_functions",
        sandbox="docker",
        docker={"image": "img"},
        options={"sandbox_factory": pf_env.default_sandbox_factory},
    )
    with pytest.raises(ValueError, match="both choose the sandbox"):
        build_environment(config)


def test_python_functions_grading_closes_every_sandbox_it_opened() -> None:
    env = pf_env.PythonFunctionsEnv()
    task = next(iter(env.tasks.values()))
    opened: list[Any] = []

    class Recording:
        def __init__(self, workdir: Path) -> None:
            self.workdir, self.closed = workdir, 0
            opened.append(self)

        def exec(self, action: dict) -> str:
            return "harness never ran"

        def trajectory(self) -> list[dict]:
            return [{"exit_code": 1}]

        def close(self) -> None:
            self.closed += 1
            raise docker.errors.APIError("close failing must not fail grading")

    env.sandbox_factory = Recording
    code = f"def {task.entry_point}(*args, **kwargs):\n    return None\n"
    reward, _, error, info = env.grade(task, f"```python\n{code}```")
    assert (reward, info.get("infrastructure_error")) == (0.0, True)
    assert "sandbox did not start" in error
    assert [s.closed for s in opened] == [1]


# --- with a real daemon ---------------------------------------------------------------------


def _daemon_client() -> Any:
    try:
        found = docker.from_env()
        found.ping()
        return found
    except Exception:
        return None


CLIENT = _daemon_client()
TEST_IMAGE = os.environ.get("CR_DOCKER_TEST_IMAGE", "python:3.11-slim")


@pytest.mark.skipif(CLIENT is None, reason="no Docker daemon answers ping()")
@pytest.mark.integration
@pytest.mark.slow
def test_real_boot_scrubs_labels_owner_and_close_survives_a_removed_container(
    tmp_path: Path,
) -> None:
    if not CLIENT.images.list(name=TEST_IMAGE):
        pytest.skip(f"image {TEST_IMAGE} not present locally (set CR_DOCKER_TEST_IMAGE)")
    os.chmod(tmp_path, 0o777)
    workdir = _leaky_workdir(tmp_path)
    sandbox = DockerSandbox(workdir, exec_timeout_s=20)
    sandbox.boot(TEST_IMAGE)
    try:
        assert "HEAD" not in sandbox.exec({"command": "ls -a .git 2>&1"})
        container = CLIENT.containers.get(sandbox._container.id)
        assert container.labels[OWNER_PID_LABEL] == str(os.getpid())
        assert reap_leaked(CLIENT, stale_only=True) == 0  # ours, and we are alive
        container.remove(force=True)  # removed behind the sandbox's back
    finally:
        sandbox.close()  # must not raise
        sandbox.close()
