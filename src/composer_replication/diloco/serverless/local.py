"""``LocalProcessExecutor``: replicas as local processes (laptops, CI, one big box).

Each replica is ``python -m composer_replication.diloco.serverless.runner`` in its own
session with the rank in ``REPLICA_RANK`` (or ``entrypoint_args["rank_env"]``), stdout and
stderr in ``<workdir>/<launch>-rank_RRRR.log``, its exit code in ``...-rank_RRRR.exit`` and
what its entrypoint returned in ``...-rank_RRRR.result.json`` (``collect`` puts it in each
row's ``result``). Handles carry the pid, the start time (``start_ts``) and those paths, so ``poll``/``stream_logs``/``cancel`` also work from another
process (the ``diloco status`` command). Replicas share this machine's network, but DiLoCo
runs here still meet through the object store, like serverless ones.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from composer_replication.common.pids import pid_alive, same_process, start_ticks
from composer_replication.diloco.serverless.base import (
    RANK_ENV,
    WORLD_SIZE_ENV,
    ReplicaHandle,
    ReplicaStatus,
    check_launch_args,
    collect_by_polling,
    launch_spec,
)
from composer_replication.diloco.serverless.runner import read_result


class LocalProcessExecutor:
    """Spawn ``n`` local replica processes; ``workdir`` holds their logs and exit codes."""

    backend_name = "local_process"
    supports_inter_replica_network = True

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        *,
        python: str | None = None,
        env: dict[str, str] | None = None,
        poll_interval_s: float = 0.2,
    ) -> None:
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="diloco-local-"))
        self.python = python or sys.executable
        self.env = dict(env or {})
        self.poll_interval_s = poll_interval_s
        self._procs: dict[int, subprocess.Popen[bytes]] = {}

    def launch_replicas(
        self,
        n_replicas: int,
        entrypoint: str | Callable[..., Any],
        entrypoint_args: dict[str, Any],
        *,
        gpu: str | None = None,
        timeout: int = 3600,
    ) -> list[ReplicaHandle]:
        """Start the replicas on this machine's devices.

        ``gpu`` cannot reserve anything locally (the replicas see the devices this machine
        has): when it is given and no CUDA device is visible, a ``UserWarning`` says so and
        the replicas run on the CPU. A callable entrypoint must be importable by ``module.qualname``; its module's folder
        is put on the replicas' PYTHONPATH so test and script modules work too.
        """
        check_launch_args(n_replicas, timeout)
        if gpu is not None:
            _warn_without_gpu(gpu)
        spec, entrypoint_args = launch_spec(entrypoint, entrypoint_args, n_replicas)
        rank_env = str(entrypoint_args.get("rank_env", RANK_ENV))
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        extra_path = _module_dir(entrypoint)
        if extra_path:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH")) if p)
        handles = []
        launch_id = uuid.uuid4().hex[:8]  # several launches may share one workdir
        for rank in range(n_replicas):
            log = self.workdir / f"{launch_id}-rank_{rank:04d}.log"
            exit_file = self.workdir / f"{launch_id}-rank_{rank:04d}.exit"
            result_file = self.workdir / f"{launch_id}-rank_{rank:04d}.result.json"
            cmd = [self.python, "-m", "composer_replication.diloco.serverless.runner"]
            cmd += ["--entrypoint", spec, "--args-json", json.dumps(entrypoint_args)]
            cmd += ["--exit-file", str(exit_file), "--result-file", str(result_file)]
            replica_env = {**env, rank_env: str(rank), WORLD_SIZE_ENV: str(n_replicas)}
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    cmd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=replica_env,
                    start_new_session=True,  # cancel signals the whole process group
                )
            self._procs[rank] = proc
            metadata = {
                "pid": proc.pid,
                # the pid alone is reused once the replica is gone: its start identifies it
                "start_ticks": start_ticks(proc.pid),
                "start_ts": time.time(),
                "log_path": str(log),
                "exit_path": str(exit_file),
                "result_path": str(result_file),
                "deadline": time.time() + timeout,
            }
            handles.append(ReplicaHandle(rank, self.backend_name, metadata))
        return handles

    def _exit_code(self, handle: ReplicaHandle) -> int | None:
        proc = self._procs.get(handle.rank)
        if proc is not None and proc.pid == handle.metadata["pid"] and proc.poll() is not None:
            return proc.returncode
        path = Path(handle.metadata["exit_path"])
        if path.exists():
            return int(path.read_text().strip() or 1)
        return None

    def _is_replica(self, handle: ReplicaHandle) -> bool:
        """The recorded pid still runs AND is the replica launched (not a process that got
        the pid after it was gone)."""
        meta = handle.metadata
        return same_process(
            int(meta["pid"]), ticks=meta.get("start_ticks"), started_near=meta.get("start_ts")
        )

    def poll(self, handle: ReplicaHandle) -> ReplicaStatus:
        if Path(handle.metadata["log_path"] + ".cancelled").exists():
            return "cancelled"
        code = self._exit_code(handle)
        if code is None and not self._is_replica(handle) and pid_alive(int(handle.metadata["pid"])):
            return "gone"  # its pid belongs to another process now
        if code is None and self._is_replica(handle):
            if time.time() > float(handle.metadata.get("deadline", float("inf"))):
                self.cancel(handle)  # the launch timeout is a hard deadline, as on the clouds
                return "cancelled"
            return "running"
        if code is None:
            code = self._exit_code(handle)  # it may have finished between the two checks
        return "succeeded" if code == 0 else "failed"

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        path = Path(handle.metadata["log_path"])
        if not path.exists():
            return ""
        lines = path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n_lines:])

    def cancel(self, handle: ReplicaHandle) -> None:
        """SIGTERM the replica's process group, SIGKILL after 5 s; finished ones are left, and
        so is a process that is not the replica (its pid reused): only a running replica,
        identified by pid and start time, leading its own process group, is signalled."""
        pid = int(handle.metadata["pid"])
        if self._exit_code(handle) is not None or not self._is_replica(handle):
            return
        Path(handle.metadata["log_path"] + ".cancelled").touch()
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            try:
                if not self._is_replica(handle) or os.getpgid(pid) != pid:
                    return
                os.killpg(pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if not self._is_replica(handle):
                    return
                time.sleep(0.05)

    def collect(
        self, handles: list[ReplicaHandle], *, timeout: float | None = None
    ) -> list[dict[str, Any]]:
        """One row per rank: the protocol's keys, ``pid``, ``log_path``, and ``result`` (what
        the entrypoint returned; its ``repr`` string when that was not JSON-serialisable,
        as ``result_kind`` says: ``"json"``, ``"repr"``, or None without a result)."""

        def row(handle: ReplicaHandle, status: str) -> dict[str, Any]:
            code = self._exit_code(handle)
            error = None
            if status == "failed":
                error = self.stream_logs(handle, n_lines=20) or f"exit code {code}"
            elif status == "gone":
                error = (
                    f"the replica (pid {handle.metadata['pid']}) is gone without an exit "
                    "code; its pid belongs to another process now"
                )
            kind, result = None, None
            if status == "succeeded" and handle.metadata.get("result_path"):
                kind, result = read_result(handle.metadata["result_path"])
            return {
                "exit_code": code,
                "error": error,
                "pid": handle.metadata["pid"],
                "log_path": handle.metadata["log_path"],
                "result": result,
                "result_kind": kind,
            }

        return collect_by_polling(self, handles, timeout, self.poll_interval_s, row)


def _warn_without_gpu(gpu: str) -> None:
    import torch  # the replicas need it anyway; only asked when a GPU is requested

    if not torch.cuda.is_available():
        warnings.warn(
            f"LocalProcessExecutor: gpu={gpu!r} was requested but this machine has no visible "
            "CUDA device, so the replicas run on the CPU; pass gpu=None to silence this, or "
            "use a cloud executor to get GPUs",
            UserWarning,
            stacklevel=3,
        )


def _module_dir(entrypoint: Any) -> str | None:
    if isinstance(entrypoint, str):
        return None
    module = sys.modules.get(getattr(entrypoint, "__module__", ""), None)
    path = getattr(module, "__file__", None)
    if not path or "composer_replication" in Path(path).parts:
        return None
    return str(Path(path).resolve().parent)
