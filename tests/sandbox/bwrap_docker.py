"""A Docker client stand-in for machines without a daemon: a container's execs run in
bubblewrap, with the container's binds at their container paths.

It answers what `DockerSandbox` calls (``containers.run(**container_kwargs)``, ``api.
exec_create / exec_start / exec_inspect``, ``containers.list / get``, container
``remove / restart``) and honours what a test run depends on: each volume at its bind
(read-write or read-only), a root filesystem of the host's top-level directories made
read-only, a private /tmp, no network, the working directory, the ``user`` (as root we
switch to it; otherwise it is the uid inside the user namespace), and the image's
environment, then the container's, then the exec's. The "image" is the host's root
filesystem plus ``image_env`` and ``image_binds`` (read-only host paths, e.g. a pytest
bundle). So the command line `DockerSandbox` builds runs for real, end to end.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any

import docker.errors

BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Top-level host entries the container gets its own of.
_OWN_TOP_LEVEL = frozenset({"proc", "dev", "tmp", "sys", "run"})


def bwrap_available() -> bool:
    return shutil.which("bwrap") is not None


def _ids(user: str) -> tuple[int, int]:
    uid, _, gid = user.partition(":")
    return int(uid), int(gid or uid)


class StandInContainer:
    def __init__(self, client: BwrapDockerClient, cid: str, kwargs: dict[str, Any]) -> None:
        self.client, self.id, self.kwargs = client, cid, kwargs
        self.name = kwargs.get("name", cid)
        self.attrs = {"Id": cid, "Labels": dict(kwargs.get("labels", {})), "State": "running"}

    def remove(self, force: bool = False) -> None:
        if self.client.containers.by_id.pop(self.id, None) is None:
            raise docker.errors.NotFound(f"No such container: {self.id}")
        self.restart()

    def restart(self, timeout: int = 0) -> None:
        for proc in self.client.api.running(self.id):
            proc.kill()

    def argv(self, cmd: Sequence[str], user: str, workdir: str, env: Mapping[str, str]) -> list:
        """The bubblewrap command line of one exec in this container."""
        kwargs = self.kwargs
        volumes = kwargs.get("volumes", {})
        tops = {PurePosixPath(spec["bind"]).parts[1] for spec in volumes.values()}
        args = ["bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"]
        uid, gid = _ids(user or kwargs["user"])
        args += ["--uid", str(uid), "--gid", str(gid), "--tmpfs", "/"]
        for entry in sorted(os.listdir("/")):
            path = "/" + entry
            if entry in _OWN_TOP_LEVEL or entry in tops:
                continue
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        for path in self.client.image_binds:
            args += ["--ro-bind", path, path]
        for host, spec in volumes.items():
            args += ["--bind" if spec["mode"] == "rw" else "--ro-bind", host, spec["bind"]]
        if kwargs.get("read_only"):
            args += ["--remount-ro", "/"]
        args += ["--chdir", workdir or kwargs["working_dir"], "--clearenv"]
        merged = {
            "PATH": BASE_PATH,
            **self.client.image_env,
            **kwargs.get("environment", {}),
            **env,
        }
        for key, value in merged.items():
            args += ["--setenv", key, value]
        return [*args, "--", *cmd]


class StandInAPI:
    def __init__(self, client: BwrapDockerClient) -> None:
        self.client = client
        self.execs: dict[str, dict[str, Any]] = {}
        self._ids = itertools.count()

    def exec_create(
        self,
        container: str,
        cmd: Sequence[str],
        user: str = "",
        workdir: str | None = None,
        environment: Mapping[str, str] | None = None,
    ) -> dict[str, str]:
        exec_id = f"exec{next(self._ids)}"
        self.execs[exec_id] = {
            "container": container,
            "cmd": list(cmd),
            "user": user,
            "workdir": workdir,
            "environment": dict(environment or {}),
            "proc": None,
        }
        return {"Id": exec_id}

    def running(self, container: str) -> list[subprocess.Popen]:
        return [
            e["proc"]
            for e in self.execs.values()
            if e["container"] == container and e["proc"] is not None
        ]

    def exec_start(self, exec_id: str, stream: bool = False) -> Iterator[bytes]:
        entry = self.execs[exec_id]
        container = self.client.containers.by_id[entry["container"]]
        argv = container.argv(entry["cmd"], entry["user"], entry["workdir"], entry["environment"])
        drop = None
        if os.geteuid() == 0:  # become the container's user, as the daemon would
            uid, gid = _ids(entry["user"] or container.kwargs["user"])

            def drop() -> None:
                os.setgroups([])
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)

        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd="/",
            env={"PATH": BASE_PATH},
            preexec_fn=drop,
        )
        entry["proc"] = proc
        assert proc.stdout is not None
        while chunk := proc.stdout.read1(65536):
            yield chunk
        proc.wait()

    def exec_inspect(self, exec_id: str) -> dict[str, Any]:
        proc = self.execs[exec_id]["proc"]
        return {"ExitCode": proc.wait() if proc is not None else None}


class StandInContainers:
    def __init__(self, client: BwrapDockerClient) -> None:
        self.client = client
        self.by_id: dict[str, StandInContainer] = {}
        self._ids = itertools.count()

    def run(self, **kwargs: Any) -> StandInContainer:
        container = StandInContainer(self.client, f"standin{next(self._ids)}", kwargs)
        self.by_id[container.id] = container
        return container

    def list(self, **kwargs: Any) -> list[StandInContainer]:
        return list(self.by_id.values())

    def get(self, name: str) -> StandInContainer:
        for container in self.by_id.values():
            if name in (container.id, container.name):
                return container
        raise docker.errors.NotFound(f"No such container: {name}")


class BwrapDockerClient:
    """`docker.DockerClient`'s surface that `DockerSandbox` uses, served by bubblewrap."""

    def __init__(
        self, image_env: Mapping[str, str] | None = None, image_binds: Sequence[str] = ()
    ) -> None:
        self.image_env = dict(image_env or {})
        self.image_binds = list(image_binds)
        self.containers = StandInContainers(self)
        self.api = StandInAPI(self)

    def ping(self) -> bool:
        return True

    def info(self) -> dict[str, Any]:
        return {"Runtimes": {"runc": {}}}
