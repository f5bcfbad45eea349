"""``ModalExecutor``: one ``Function.spawn`` call per replica on a deployed Modal function.

Modal runs Python functions, not containers we describe, so the run needs a deployed
function that takes ``(rank, world_size, entrypoint, entrypoint_args)`` and calls
``modal_replica`` (this module) with them, e.g. in the user's Modal app::

    image = modal.Image.debian_slim().pip_install("composer-replication[diloco]")
    app = modal.App("composer-diloco")

    @app.function(image=image, timeout=24 * 3600)
    def replica(rank, world_size, entrypoint, entrypoint_args):
        from composer_replication.diloco.serverless.modal import modal_replica
        return modal_replica(rank, world_size, entrypoint, entrypoint_args)

Then ``ModalExecutor("composer-diloco", "replica")`` spawns ``n`` calls with
``gpu``/``timeout`` applied through ``Function.with_options``. Modal containers have no
network between them: replicas meet through the object-store rendezvous. Status comes from
the call graph (Modal does not tell queued from running for a spawned call: both read
"running"); logs from ``FunctionCall.logs.tail``. The ``modal`` SDK is imported lazily;
pass ``modal_module`` to inject a client shaped like it.
"""

from __future__ import annotations

import os
from typing import Any

from composer_replication.diloco.serverless.base import (
    RANK_ENV,
    WORLD_SIZE_ENV,
    ReplicaHandle,
    ReplicaStatus,
    check_launch_args,
    collect_by_polling,
    entrypoint_string,
    import_sdk,
    launch_one_by_one,
)

# modal.call_graph.InputStatus names -> our statuses
_STATUS: dict[str, ReplicaStatus] = {
    "PENDING": "running",
    "SUCCESS": "succeeded",
    "FAILURE": "failed",
    "INIT_FAILURE": "failed",
    "TIMEOUT": "failed",
    "TERMINATED": "cancelled",
}


def modal_replica(
    rank: int, world_size: int, entrypoint: str, entrypoint_args: dict[str, Any]
) -> Any:
    """Body of the deployed Modal function: set the rank variables and run the entrypoint."""
    from composer_replication.diloco.serverless.runner import run_entrypoint

    rank_env = str(entrypoint_args.get("rank_env", RANK_ENV))
    os.environ[rank_env] = str(rank)
    os.environ[WORLD_SIZE_ENV] = str(world_size)
    return run_entrypoint(entrypoint, entrypoint_args)


class ModalExecutor:
    """Spawn each rank as a call of ``app_name``/``function_name`` (deployed on Modal)."""

    backend_name = "modal"
    supports_inter_replica_network = False

    def __init__(
        self,
        app_name: str,
        function_name: str = "replica",
        *,
        environment_name: str | None = None,
        modal_module: Any = None,
        poll_interval_s: float = 10.0,
    ) -> None:
        self.app_name = app_name
        self.function_name = function_name
        self.environment_name = environment_name
        self._modal = modal_module
        self.poll_interval_s = poll_interval_s

    def _sdk(self) -> Any:
        if self._modal is None:
            self._modal = import_sdk(
                "modal",
                "ModalExecutor needs the Modal SDK: pip install modal (and `modal token new`)",
            )
        return self._modal

    def _call(self, handle: ReplicaHandle) -> Any:
        return self._sdk().FunctionCall.from_id(handle.metadata["call_id"])

    def launch_replicas(
        self,
        n_replicas: int,
        entrypoint: Any,
        entrypoint_args: dict[str, Any],
        *,
        gpu: str | None = None,
        timeout: int = 3600,
    ) -> list[ReplicaHandle]:
        check_launch_args(n_replicas, timeout)
        spec = entrypoint_string(entrypoint)
        function = self._sdk().Function.from_name(
            self.app_name, self.function_name, environment_name=self.environment_name
        )
        options: dict[str, Any] = {"timeout": int(timeout)}
        if gpu is not None:
            options["gpu"] = gpu  # Modal's own names: "A100", "H100:8", "L40S", ...
        function = function.with_options(**options)

        def start_rank(rank: int) -> dict[str, Any]:
            call = function.spawn(
                rank=rank, world_size=n_replicas, entrypoint=spec, entrypoint_args=entrypoint_args
            )
            return {"call_id": call.object_id, "app_name": self.app_name}

        return launch_one_by_one(
            self,
            n_replicas,
            start_rank,
            lambda rank, exc: (
                f"Modal spawn of rank {rank} failed: {exc}; cancelled the "
                f"{rank} replicas already spawned"
            ),
        )

    def poll(self, handle: ReplicaHandle) -> ReplicaStatus:
        graph = self._call(handle).get_call_graph()
        if not graph:
            return "pending"
        status = getattr(graph[0].status, "name", str(graph[0].status))
        return _STATUS.get(status, "running")

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        entries = self._call(handle).logs.tail(n_lines)
        return "\n".join(str(getattr(e, "message", e)).rstrip("\n") for e in entries)

    def cancel(self, handle: ReplicaHandle) -> None:
        self._call(handle).cancel(terminate_containers=True)

    def collect(
        self, handles: list[ReplicaHandle], *, timeout: float | None = None
    ) -> list[dict[str, Any]]:
        def row(handle: ReplicaHandle, status: str) -> dict[str, Any]:
            result, error = None, None
            if status in ("succeeded", "failed"):
                try:
                    result = self._call(handle).get(timeout=0)
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"
            return {
                "exit_code": {"succeeded": 0, "failed": 1}.get(status),
                "error": error,
                "call_id": handle.metadata["call_id"],
                "result": result,
            }

        return collect_by_polling(self, handles, timeout, self.poll_interval_s, row)
