"""`DockerSandbox`: one locked-down container per task, driven through the Docker SDK.

The container has no network, a read-only root filesystem, a size-limited tmpfs /tmp, the
task workdir as its only writable bind, every capability dropped, no-new-privileges, a
non-root user and pids/memory/CPU limits. With `runtime="runsc"` (gVisor, see
`runsc_available()`) the kernel is no longer shared, which is the backend to choose for
hostile code. Commands are wrapped in `timeout -s KILL` inside the container, with a
host-side watchdog that restarts the container if even that hangs.

Test runs given a ``GuardSpec`` run under the same behaviour guard as the local sandbox
(``sandbox.behaviour_guard``): its directory is bound read-only into every container at
``GUARD_MOUNT`` (a path the sandbox user cannot write, so no agent command can replace it),
and a guarded run's command puts it first on ``PYTHONPATH`` and in ``PYTEST_PLUGINS``
with its configuration in the exec environment. The image's Python must have audit hooks
(3.8 or newer); the first guarded run checks, and refuses to run unguarded.

Before the container starts, `boot()` runs `scrub_tree` on the workdir: version-control
history, bytecode, tool caches, editor backups and packaged copies could hand the agent the
reference solution (the primary control against such leaks; see `datagen.scrub`).

Containers carry the label `composer_replication=datagen` plus their owner (host name, pid
and process start of the Python process that booted them). `reap_leaked()` force-removes every
labelled container; `reap_leaked(stale_only=True)`, which every `boot()` runs first, removes
only the ones whose owner process is gone (a crashed run's leftovers) and never touches the
sandboxes of processes still running, here or on another host. `close()` never raises.

Without the `docker` SDK every entry point raises `RuntimeError` naming the extra to
install; without a reachable daemon, a `RuntimeError` saying so.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from composer_replication.sandbox.base import (
    SANDBOX_DENYLIST,
    CommandLog,
    GuardSpec,
    TestRunResult,
    action_command,
)
from composer_replication.sandbox.docker_daemon import (
    LABEL,
    OWNER_HOST_LABEL,
    OWNER_PID_LABEL,
    OWNER_START_LABEL,
    _docker_module,
    _is_not_found,
    _short_id,
    docker_client,
    owner_labels,
    reap_leaked,
    runsc_available,
)
from composer_replication.sandbox.process import OutputCapture, ProcessOutcome
from composer_replication.sandbox.pytest_support import (
    SANDBOX_ENV,
    WORKTREE_ENV,
    entry_for_tests,
    guard_config,
    guard_site_dir,
    guarded_command,
    result_of_tests,
)
from composer_replication.sandbox.scrub import scrub_tree
from composer_replication.sandbox.workdir import hand_over

__all__ = [
    "GUARD_MOUNT",
    "LABEL",
    "OWNER_HOST_LABEL",
    "OWNER_PID_LABEL",
    "OWNER_START_LABEL",
    "DockerSandbox",
    "DockerSandboxFactory",
    "docker_client",
    "owner_labels",
    "reap_leaked",
    "runsc_available",
]

log = logging.getLogger(__name__)

# Extra seconds the host watchdog grants beyond the in-container `timeout`.
_WATCHDOG_SLACK_S = 10.0
#: Where every container sees the behaviour guard's directory (bound read-only).
GUARD_MOUNT = "/opt/composer-replication-guard"
_AUDIT_HOOK_PROBE = "import sys; sys.exit(0 if hasattr(sys, 'addaudithook') else 3)"


def _check_settings(
    user: str,
    container_workdir: str,
    pids_limit: int,
    nano_cpus: int,
    exec_timeout_s: float,
) -> None:
    """The `DockerSandbox` settings checks, shared with `DockerSandboxFactory`."""
    if user.partition(":")[0] in ("", "0", "root"):
        raise ValueError(f"user must be a non-root 'uid:gid', got {user!r}; e.g. '1000:1000'")
    if not PurePosixPath(container_workdir).is_absolute():
        raise ValueError(f"container_workdir must be absolute, got {container_workdir!r}")
    if pids_limit <= 0 or nano_cpus <= 0 or exec_timeout_s <= 0:
        raise ValueError(
            "pids_limit, nano_cpus and exec_timeout_s must be > 0, got "
            f"{pids_limit!r}, {nano_cpus!r}, {exec_timeout_s!r}"
        )


def _parse_user(user: str) -> tuple[int | None, int | None]:
    uid_text, _, gid_text = user.partition(":")
    if not uid_text.isdigit():
        return None, None  # a user name: only the image knows its uid
    return int(uid_text), int(gid_text) if gid_text.isdigit() else int(uid_text)


class DockerSandbox(CommandLog):
    """A task container with the whole lockdown; see the module docstring.

    Args:
        workdir: Host directory bind-mounted read-write at `container_workdir`.
        runtime: Container runtime, e.g. "runsc" for gVisor; None = the daemon default.
        mem_limit, memswap_limit: Memory cap (equal values = no swap).
        pids_limit: Maximum processes in the container (fork bombs).
        nano_cpus: CPU quota in units of 1e-9 CPUs.
        user: "uid:gid" (or a name) to run as; root is refused.
        container_workdir: Where the workdir appears inside.
        tmpfs_size: Size of the tmpfs mounted on /tmp.
        exec_timeout_s: Wall-clock limit per `exec`/`run_tests`.
        keep_root_writable: Leave the image's root filesystem writable (default read-only).
        client: A docker client to use instead of `docker.from_env()`.
        python: Interpreter name inside the image for `run_tests`.
        max_output_bytes: Output kept per call (head and tail).
        scrub_workdir: Run `scrub_tree` on the workdir in `boot()` (default). It deletes VCS
            history, caches, backups and packaged copies in place: the workdir must be a
            task copy. Pass False only for a directory that holds no reference solution.
        reap_stale: Remove a crashed run's leftover containers in `boot()` (default; see
            `reap_leaked(stale_only=True)`: live sandboxes of other processes are kept).
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        runtime: str | None = None,
        mem_limit: str = "1g",
        memswap_limit: str = "1g",
        pids_limit: int = 256,
        nano_cpus: int = 2_000_000_000,
        user: str = "1000:1000",
        container_workdir: str = "/work",
        tmpfs_size: str = "64m",
        exec_timeout_s: float = 600,
        keep_root_writable: bool = False,
        *,
        client: Any = None,
        python: str = "python",
        max_output_bytes: int = 200_000,
        denylist: frozenset[str] = SANDBOX_DENYLIST,
        scrub_workdir: bool = True,
        reap_stale: bool = True,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        if not self.workdir.is_dir():
            raise ValueError(f"workdir {str(workdir)!r} is not an existing directory")
        _check_settings(user, container_workdir, pids_limit, nano_cpus, exec_timeout_s)
        self.runtime = runtime
        self.mem_limit = mem_limit
        self.memswap_limit = memswap_limit
        self.pids_limit = pids_limit
        self.nano_cpus = nano_cpus
        self.user = user
        self.container_workdir = container_workdir
        self.tmpfs_size = tmpfs_size
        self.exec_timeout_s = float(exec_timeout_s)
        self.keep_root_writable = keep_root_writable
        self.python = python
        self.max_output_bytes = max_output_bytes
        self.denylist = denylist
        self.scrub_workdir = scrub_workdir
        self.reap_stale = reap_stale
        self._client = client
        self._container: Any = None
        self._guard_checked = False
        self._trajectory: list[dict[str, Any]] = []

    def container_kwargs(self, image: str) -> dict[str, Any]:
        """Keyword arguments for `client.containers.run`: the whole lockdown in one place.

        `boot()` adds the bookkeeping on top: a unique `name` and the `owner_labels()`.
        """
        kwargs: dict[str, Any] = {
            "image": image,
            "command": ["tail", "-f", "/dev/null"],  # keeps the container up; GNU and busybox
            "detach": True,
            "network_mode": "none",
            "read_only": not self.keep_root_writable,
            "tmpfs": {"/tmp": f"rw,nosuid,nodev,size={self.tmpfs_size}"},
            "volumes": {
                str(self.workdir): {"bind": self.container_workdir, "mode": "rw"},
                str(guard_site_dir()): {"bind": GUARD_MOUNT, "mode": "ro"},
            },
            "working_dir": self.container_workdir,
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "user": self.user,
            "pids_limit": self.pids_limit,
            "mem_limit": self.mem_limit,
            "memswap_limit": self.memswap_limit,
            "nano_cpus": self.nano_cpus,
            "labels": dict(LABEL),
            "environment": {**SANDBOX_ENV, WORKTREE_ENV: self.container_workdir},
            "init": True,  # reaps orphans inside the container
            "ipc_mode": "private",
        }
        if self.runtime is not None:
            kwargs["runtime"] = self.runtime
        return kwargs

    # lifecycle ----------------------------------------------------------------------------
    def boot(self, image: str | None) -> None:
        """Scrub the workdir, reap stale containers, then create and start the container.

        In order: `scrub_tree(workdir)` (unless `scrub_workdir=False`; the removed paths are
        recorded in the boot entry of the trajectory as `scrubbed`, relative to the
        workdir), `reap_leaked(stale_only=True)` (unless `reap_stale=False`; a failure there
        is logged, never fatal), then `containers.run` with `container_kwargs(image)`, a
        unique name and the owner labels. A container that was created but failed to start
        is removed again.

        Raises:
            ValueError: no image name; the workdir is not a real directory (scrub).
            RuntimeError: already booted, no SDK or daemon, or the image is not present.
        """
        if not image:
            raise ValueError("DockerSandbox.boot needs an image name, e.g. 'python:3.11-slim'")
        if self._container is not None:
            raise RuntimeError("DockerSandbox already booted; call close() before booting again")
        client = docker_client(self._client)
        self._client = client
        scrubbed = scrub_tree(self.workdir) if self.scrub_workdir else []
        if self.reap_stale:
            try:
                reap_leaked(client, stale_only=True)
            except Exception as exc:  # housekeeping: never the reason a boot fails
                log.warning("could not reap stale sandbox containers: %s", exc)
        if os.geteuid() == 0:
            uid, gid = _parse_user(self.user)
            hand_over(self.workdir, uid, gid)
        docker = _docker_module()
        kwargs = self.container_kwargs(image)
        kwargs["name"] = f"cr-sandbox-{uuid.uuid4().hex[:16]}"
        kwargs["labels"] = {**kwargs["labels"], **owner_labels()}
        try:
            self._container = client.containers.run(**kwargs)
        except docker.errors.ImageNotFound as exc:
            raise RuntimeError(
                f"image {image!r} not found; pull it first: docker pull {image}"
            ) from exc
        except BaseException:
            self._remove_named(client, kwargs["name"])  # created but not started
            raise
        self._trajectory.append(
            {
                "type": "boot",
                "image": image,
                "isolated": True,
                "scrubbed": [str(p.relative_to(self.workdir)) for p in scrubbed],
            }
        )

    @staticmethod
    def _remove_named(client: Any, name: str) -> None:
        # never created, or already gone: nothing to clean up
        with contextlib.suppress(Exception):
            client.containers.get(name).remove(force=True)

    def close(self) -> None:
        """Remove the container. Idempotent, and never raises.

        A container that is already gone, a removal the daemon refuses, or a daemon that no
        longer answers is logged and swallowed (close runs in `finally` blocks and context
        exits, where an exception would hide the real one). A container left behind that way
        is reaped by the first `boot()` on this host after this process ends, or by
        `reap_leaked()`.
        """
        container, self._container = self._container, None
        if container is None:
            return
        try:
            container.remove(force=True)
        except Exception as exc:
            if _is_not_found(exc):  # already removed: the goal of close() is reached
                log.debug("sandbox container %s was already removed", _short_id(container))
            else:
                log.warning(
                    "could not remove sandbox container %s (%s: %s); it is reaped by the first "
                    "boot after this process ends, or by reap_leaked()",
                    _short_id(container),
                    type(exc).__name__,
                    exc,
                )

    def __enter__(self) -> DockerSandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # running --------------------------------------------------------------------------------
    def _run(self, argv: list[str], environment: Mapping[str, str] | None = None) -> ProcessOutcome:
        if self._container is None:
            raise RuntimeError("DockerSandbox is not booted; call boot(image) first")
        api = self._client.api
        wrapped = ["timeout", "-s", "KILL", str(max(1, int(self.exec_timeout_s))), *argv]
        exec_id = api.exec_create(
            self._container.id,
            wrapped,
            user=self.user,
            workdir=self.container_workdir,
            environment=dict(environment) if environment else None,
        )["Id"]
        capture = OutputCapture(self.max_output_bytes)
        start = time.monotonic()

        def pump() -> None:
            for chunk in api.exec_start(exec_id, stream=True):
                capture.add(chunk)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        reader.join(self.exec_timeout_s + _WATCHDOG_SLACK_S)
        watchdog_fired = reader.is_alive()
        if watchdog_fired:  # `timeout` missing or stuck: restart the container
            self._container.restart(timeout=0)
        duration = time.monotonic() - start
        exit_code = None if watchdog_fired else api.exec_inspect(exec_id).get("ExitCode")
        timed_out = watchdog_fired or (exit_code == 137 and duration >= self.exec_timeout_s)
        output, truncated = capture.result()
        return ProcessOutcome(exit_code, output, capture.total, truncated, timed_out, duration)

    def exec(self, action: Mapping[str, Any]) -> str:
        """Run `action["command"]` with sh in the container; combined stdout/stderr."""
        command = action_command(action)
        entry: dict[str, Any] = {"type": "exec", "command": command, "isolated": True}
        refusal = self._refusal(entry, command)
        if refusal is not None:
            return refusal
        return self._record_exec(entry, self._run(["sh", "-c", command]), self.exec_timeout_s)

    #: ``run_tests`` takes ``guard=`` (the behaviour guard runs in this backend).
    supports_behaviour_guard = True

    def guarded_run(self, argv: list[str], guard: GuardSpec) -> tuple[list[str], dict[str, str]]:
        """The command and exec environment that run ``argv`` under the behaviour guard:
        the guard bound at ``GUARD_MOUNT`` loads first in every Python process and registers
        with pytest, configured to protect ``guard`` inside ``container_workdir``."""
        return guarded_command(argv, GUARD_MOUNT), guard_config(guard, self.container_workdir)

    def _check_guard_support(self) -> None:
        if self._guard_checked:
            return
        probe = self._run([self.python, "-c", _AUDIT_HOOK_PROBE])
        if probe.exit_code != 0:
            raise RuntimeError(
                f"the behaviour guard needs audit hooks (Python 3.8 or newer) in the image; "
                f"{self.python!r} in the container exited {probe.exit_code}: "
                f"{probe.text().strip()[-300:]!r}. Use an image with Python >= 3.8"
            )
        self._guard_checked = True

    def run_tests(
        self,
        test_command: str = "python -m pytest -q",
        tests: Sequence[str] = (),
        *,
        guard: GuardSpec | None = None,
    ) -> TestRunResult:
        """Run the test command in the container; pytest writes junit into the workdir.

        With ``guard``, the run is under the behaviour guard (``sandbox.behaviour_guard``),
        as in ``LocalSubprocessSandbox``: what the agent's code did to the report, the tests,
        the runtime or pytest is refused and comes back as ``behaviour_flags``. An image
        whose Python has no audit hooks is a ``RuntimeError`` (never an unguarded run).
        """
        entry = entry_for_tests(
            test_command,
            tests,
            python=self.python,
            workdir=self.workdir,
            inside=self.container_workdir,
            guard=guard,
            guard_mount=GUARD_MOUNT,
        )
        if guard is not None:
            self._check_guard_support()
        outcome = self._run(entry.argv, entry.env)
        result = result_of_tests(entry, outcome, timeout_s=self.exec_timeout_s, isolated=True)
        return self._record_tests(test_command, tests, result)

    reap_leaked = staticmethod(reap_leaked)
    runsc_available = staticmethod(runsc_available)


# Settings a factory passes through to each DockerSandbox (not the per-call workdir/client).
_SANDBOX_SETTINGS = frozenset(inspect.signature(DockerSandbox.__init__).parameters) - {
    "self",
    "workdir",
    "client",
}


class DockerSandboxFactory:
    """`workdir -> booted DockerSandbox`: the sandbox factory environments call per attempt.

    Each call builds a `DockerSandbox(workdir, **settings)` and boots it from `image`
    (scrubbing the workdir and reaping stale containers first); the caller closes it. A boot
    that fails closes the sandbox before the error propagates.

    Args:
        image: The image every container runs (it must provide python, and pytest for
            repository tasks).
        client: A docker client shared by every sandbox; default one `docker.from_env()` per
            sandbox.
        **settings: `DockerSandbox` settings (`runtime`, `mem_limit`, `pids_limit`, ...).

    Raises:
        ValueError: an empty image, an unknown setting, or a setting `DockerSandbox` refuses
            (root user, relative container workdir, non-positive limits); checked here, so a
            misconfigured backend fails when the environment is built, not at the first
            attempt.
    """

    def __init__(self, image: str, *, client: Any = None, **settings: Any) -> None:
        if not isinstance(image, str) or not image:
            raise ValueError(
                f"DockerSandboxFactory needs an image name, got {image!r}; e.g. 'python:3.11-slim'"
            )
        unknown = sorted(set(settings) - _SANDBOX_SETTINGS)
        if unknown:
            raise ValueError(
                f"unknown DockerSandbox setting(s) {unknown}; known: {sorted(_SANDBOX_SETTINGS)}"
            )
        defaults = {
            name: p.default
            for name, p in inspect.signature(DockerSandbox.__init__).parameters.items()
            if name in _SANDBOX_SETTINGS
        }
        merged = {**defaults, **settings}
        _check_settings(
            merged["user"],
            merged["container_workdir"],
            merged["pids_limit"],
            merged["nano_cpus"],
            merged["exec_timeout_s"],
        )
        self.image = image
        self.client = client
        self.settings: dict[str, Any] = dict(settings)

    def __call__(
        self,
        workdir: str | os.PathLike[str],
        *,
        image: str | None = None,
        python: str | None = None,
        ro_binds: Sequence[str] = (),
    ) -> DockerSandbox:
        """A booted sandbox for ``workdir``, from ``image`` when given (a task's own
        image), else the factory's.

        Raises:
            ValueError: ``python`` names an interpreter on this host (a task prepared with
                a host virtualenv): no image holds it.
        """
        if python:
            raise ValueError(
                "this task's tests were prepared with a virtualenv on this host "
                f"({python}); run it with sandbox = 'local', or make its tasks again with "
                "--docker-image so that they name an image"
            )
        del ro_binds  # the host folders a local sandbox would bind: the image has its own
        sandbox = DockerSandbox(workdir, client=self.client, **self.settings)
        try:
            sandbox.boot(image or self.image)
        except BaseException:
            sandbox.close()
            raise
        return sandbox

    def __repr__(self) -> str:
        return f"DockerSandboxFactory(image={self.image!r}, settings={self.settings!r})"
