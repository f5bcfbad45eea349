"""``HFJobsExecutor``: one Hugging Face Job (``huggingface_hub.run_job``) per replica.

Each rank runs ``python -m composer_replication.diloco.serverless.runner`` in ``image``
with ``REPLICA_RANK``/``REPLICA_WORLD_SIZE`` and the scalar ``entrypoint_args``
(upper-cased) in its environment, on the flavor that ``gpu`` names (``GPU_FLAVORS``; a
literal flavor such as ``"a10g-largex2"`` passes through; ``None`` = ``cpu_flavor``).
Jobs have no network between them; the natural rendezvous is an ``hf://`` URI (a Hub
bucket or dataset repo read through ``HfFileSystem``), which needs the Hub token, so
``secrets={"HF_TOKEN": ...}`` is forwarded. Status maps ``JobStage`` (SCHEDULING ->
pending, RUNNING, COMPLETED, ERROR, CANCELED/DELETED -> cancelled). huggingface_hub is
imported lazily; ``api`` injects an ``HfApi``-shaped client.
"""

from __future__ import annotations

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
    scalar_env,
)
from composer_replication.diloco.serverless.runner import build_command

GPU_FLAVORS: dict[str, str] = {
    "T4": "t4-small",
    "L4": "l4x1",
    "L40S": "l40sx1",
    "A10G": "a10g-small",
    "A100": "a100-large",
    "H200": "h200",
}
_STAGES: dict[str, ReplicaStatus] = {
    "SCHEDULING": "pending",
    "RUNNING": "running",
    "COMPLETED": "succeeded",
    "ERROR": "failed",
    "CANCELED": "cancelled",
    "DELETED": "cancelled",
}


class HFJobsExecutor:
    """Launch each rank as an HF Job; ``rendezvous`` URIs should be ``hf://``."""

    backend_name = "hf_jobs"
    supports_inter_replica_network = False

    def __init__(
        self,
        image: str,
        *,
        namespace: str | None = None,
        cpu_flavor: str = "cpu-upgrade",
        secrets: dict[str, str] | None = None,
        token: str | None = None,
        api: Any = None,
        poll_interval_s: float = 15.0,
    ) -> None:
        self.image = image
        self.namespace = namespace
        self.cpu_flavor = cpu_flavor
        self.secrets = dict(secrets or {})
        self.token = token
        self._api = api
        self.poll_interval_s = poll_interval_s

    def _client(self) -> Any:
        if self._api is None:
            hub = import_sdk(
                "huggingface_hub",
                "HFJobsExecutor needs huggingface_hub: pip install huggingface_hub",
            )
            self._api = hub.HfApi(token=self.token)
        return self._api

    def flavor(self, gpu: str | None) -> str:
        if gpu is None:
            return self.cpu_flavor
        key = gpu.strip().upper()
        if key in GPU_FLAVORS:
            return GPU_FLAVORS[key]
        if "-" in gpu or gpu.islower():
            return gpu  # a literal HF flavor name
        raise ValueError(
            f"unknown gpu {gpu!r} for HF Jobs; known: {sorted(GPU_FLAVORS)} or a flavor name "
            "such as 'a10g-largex2' (see huggingface_hub.JobHardware)"
        )

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
        uri = str(entrypoint_args.get("rendezvous_uri", entrypoint_args.get("rendezvous", "")))
        if uri and "://" in uri and not uri.startswith(("hf://", "s3://", "gs://", "az://")):
            raise ValueError(
                f"HF Jobs replicas cannot share {uri!r}: use an hf:// (or cloud bucket) URI"
            )
        command = build_command(entrypoint_string(entrypoint), entrypoint_args)
        rank_env = str(entrypoint_args.get("rank_env", RANK_ENV))
        api = self._client()

        def start_rank(rank: int) -> dict[str, Any]:
            job = api.run_job(
                image=self.image,
                command=command,
                env={
                    **scalar_env(entrypoint_args),
                    rank_env: str(rank),
                    WORLD_SIZE_ENV: str(n_replicas),
                },
                secrets=self.secrets or None,
                flavor=self.flavor(gpu),
                timeout=int(timeout),
                labels={"diloco-rank": str(rank)},
                namespace=self.namespace,
            )
            return {"job_id": job.id, "url": getattr(job, "url", None)}

        return launch_one_by_one(
            self,
            n_replicas,
            start_rank,
            lambda rank, exc: (
                f"HF Jobs launch of rank {rank} failed: {exc}; cancelled the "
                f"{rank} replicas already launched"
            ),
        )

    def _info(self, handle: ReplicaHandle) -> Any:
        return self._client().inspect_job(
            job_id=handle.metadata["job_id"], namespace=self.namespace
        )

    def poll(self, handle: ReplicaHandle) -> ReplicaStatus:
        stage = self._info(handle).status.stage
        return _STAGES.get(str(getattr(stage, "value", stage)).upper(), "pending")

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        lines = list(
            self._client().fetch_job_logs(
                job_id=handle.metadata["job_id"], namespace=self.namespace, follow=False
            )
        )
        return "\n".join(line.rstrip("\n") for line in lines[-n_lines:])

    def cancel(self, handle: ReplicaHandle) -> None:
        self._client().cancel_job(job_id=handle.metadata["job_id"], namespace=self.namespace)

    def collect(
        self, handles: list[ReplicaHandle], *, timeout: float | None = None
    ) -> list[dict[str, Any]]:
        def row(handle: ReplicaHandle, status: str) -> dict[str, Any]:
            info = self._info(handle)
            return {
                "exit_code": {"succeeded": 0, "failed": 1}.get(status),
                "error": info.status.message if status == "failed" else None,
                "job_id": handle.metadata["job_id"],
                "url": handle.metadata.get("url"),
            }

        return collect_by_polling(self, handles, timeout, self.poll_interval_s, row)
