"""The Docker daemon side of `DockerSandbox`: the client, container ownership, leftovers.

Every sandbox container carries the label `LABEL` plus its owner (`owner_labels()`: host
name, pid and process start of the Python process that booted it). `reap_leaked()`
force-removes every labelled container; `reap_leaked(stale_only=True)`, which every
`DockerSandbox.boot()` runs first, removes only the ones whose owner process is gone (a
crashed run's leftovers) and never touches the sandboxes of processes still running, here
or on another host. The docker SDK is imported only when a client is needed.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from composer_replication.common.pids import pid_alive

log = logging.getLogger(__name__)

LABEL = {"composer_replication": "datagen"}
# Who booted a container: what lets a later boot tell a crashed run's leftovers (owner gone)
# from the live sandboxes of a concurrent process (owner running).
OWNER_HOST_LABEL = "composer_replication.owner_host"
OWNER_PID_LABEL = "composer_replication.owner_pid"
OWNER_START_LABEL = "composer_replication.owner_start"
# Without owner labels (containers of older versions) only these states are stale.
_STOPPED_STATES = frozenset({"exited", "dead"})
_INSTALL_HINT = "pip install 'composer-replication[docker]'"


def _docker_module() -> Any:
    try:
        import docker
    except ImportError as exc:
        raise RuntimeError(
            f"DockerSandbox needs the docker SDK; install it with {_INSTALL_HINT}"
        ) from exc
    return docker


def docker_client(client: Any = None) -> Any:
    """`client` if given, else `docker.from_env()` after checking the daemon answers."""
    if client is not None:
        return client
    docker = _docker_module()
    try:
        found = docker.from_env()
        found.ping()
    except docker.errors.DockerException as exc:
        raise RuntimeError(
            f"no Docker daemon reachable ({exc}); start dockerd, or point DOCKER_HOST at a "
            "running daemon, or use LocalSubprocessSandbox"
        ) from exc
    return found


def _process_start(pid: int) -> str | None:
    """`<boot id>/<start time in clock ticks>` of `pid` (Linux /proc), or None if unknown.

    A pid alone is not an identity: pids are reused, and a trainer in a container is often
    pid 1 or 7 in every run. The kernel boot id plus the start time is.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # the command name may contain spaces
    return f"{boot_id}/{fields[19]}" if len(fields) > 19 else None


def owner_labels() -> dict[str, str]:
    """The owner labels `boot()` adds: this host's name, this process's pid and start."""
    labels = {OWNER_HOST_LABEL: socket.gethostname(), OWNER_PID_LABEL: str(os.getpid())}
    start = _process_start(os.getpid())
    if start is not None:
        labels[OWNER_START_LABEL] = start
    return labels


def _owner_gone(labels: Mapping[str, str]) -> bool:
    """True only when the process that booted the container is known to have ended."""
    if labels.get(OWNER_HOST_LABEL) != socket.gethostname():
        return False  # another host (or pid namespace): its processes cannot be checked
    try:
        pid = int(labels[OWNER_PID_LABEL])
    except (KeyError, TypeError, ValueError):
        return False
    if pid <= 0 or not pid_alive(pid):
        return True
    recorded = labels.get(OWNER_START_LABEL)
    current = _process_start(pid)
    return recorded is not None and current is not None and recorded != current  # pid reused


def _labels_of(container: Any) -> dict[str, str]:
    attrs = getattr(container, "attrs", None) or {}
    labels = attrs.get("Labels")  # sparse list entries carry them at the top level
    if labels is None:
        labels = (attrs.get("Config") or {}).get("Labels")
    return dict(labels or {})


def _state_of(container: Any) -> str:
    state = (getattr(container, "attrs", None) or {}).get("State")
    if isinstance(state, Mapping):
        state = state.get("Status")
    return str(state or "")


def _is_stale(container: Any) -> bool:
    labels = _labels_of(container)
    if OWNER_PID_LABEL in labels:
        return _owner_gone(labels)
    return _state_of(container) in _STOPPED_STATES


def reap_leaked(client: Any = None, *, stale_only: bool = False) -> int:
    """Force-remove containers labelled `composer_replication=datagen`; return how many.

    Args:
        client: A docker client; default `docker.from_env()` (daemon checked).
        stale_only: False (the default): every labelled container, including the running
            sandboxes of other processes using the same daemon; call it only when no other
            run is active. True: only a crashed run's leftovers, i.e. containers whose owner
            process (owner labels, this host) has ended, whatever their state, and unowned
            containers (older versions) that are exited or dead. Containers owned by a live
            process or by another host are kept. Each `boot()` runs this.

    A container that disappears or cannot be removed meanwhile (another process reaping it,
    removal already in progress) is logged and not counted; the other ones are still removed.
    """
    found = docker_client(client)
    key, value = next(iter(LABEL.items()))
    labelled = found.containers.list(all=True, filters={"label": f"{key}={value}"}, sparse=True)
    removed = 0
    for container in labelled:
        if stale_only and not _is_stale(container):
            continue
        try:
            container.remove(force=True)
        except Exception as exc:  # gone already, or being removed by a concurrent reaper
            log.warning("could not remove leaked container %s: %s", _short_id(container), exc)
            continue
        removed += 1
    if removed:
        log.info("removed %d leaked sandbox container(s)", removed)
    return removed


def _short_id(container: Any) -> str:
    return str(getattr(container, "id", "?"))[:12]


def _is_not_found(exc: BaseException) -> bool:
    """The daemon said 404: the container does not exist (any more)."""
    if getattr(getattr(exc, "response", None), "status_code", None) == 404:
        return True
    try:
        import docker.errors
    except ImportError:
        return False
    return isinstance(exc, docker.errors.NotFound)


def runsc_available(client: Any = None) -> bool:
    """True when the daemon offers the gVisor runtime (`runsc`)."""
    runtimes = docker_client(client).info().get("Runtimes") or {}
    return "runsc" in runtimes
