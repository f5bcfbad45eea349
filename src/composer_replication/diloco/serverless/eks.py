"""``EKSExecutor``: all replicas as ONE Kubernetes Indexed Job (EKS or any cluster).

``completions == parallelism == n_replicas`` and ``completionMode: Indexed``: Kubernetes
gives every pod a completion index 0..n-1, exported to the container as ``REPLICA_RANK``
through the downward API. Scalar ``entrypoint_args`` also become upper-cased environment
variables; the container runs ``python -m composer_replication.diloco.serverless.runner``
(or ``command``). ``gpu`` picks limits, a node selector and a toleration from ``GPU_TABLE``;
``timeout`` becomes ``activeDeadlineSeconds``. Per-rank status comes from the Job's
completed/failed indexes and the index's pod; ``cancel`` deletes the whole Job
(background propagation), because one rank of a DiLoCo run cannot finish without the
others. 404s are tolerated everywhere (a deleted or TTL-collected Job reads "cancelled").
The kubernetes client is imported lazily; ``batch_api``/``core_api`` are injectable.
"""

from __future__ import annotations

import uuid
from typing import Any

from composer_replication.diloco.serverless.base import (
    RANK_ENV,
    WORLD_SIZE_ENV,
    ReplicaHandle,
    ReplicaStatus,
    check_launch_args,
    collect_by_polling,
    import_sdk,
    launch_spec,
    scalar_env,
)
from composer_replication.diloco.serverless.runner import build_command

INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
GPU_NODE_LABEL = "karpenter.k8s.aws/instance-gpu-name"  # Karpenter's well-known GPU label
# GPU name -> node-selector value (count per replica comes from "NAME:COUNT", default 1)
GPU_TABLE: dict[str, str] = {"A100": "a100", "H100": "h100", "A10G": "a10g", "T4": "t4"}


def parse_gpu(gpu: str) -> tuple[str, int]:
    """``"H100"`` -> ``("H100", 1)``, ``"a100:8"`` -> ``("A100", 8)``; unknown -> ValueError."""
    name, _, count = gpu.partition(":")
    name = name.strip().upper()
    if name not in GPU_TABLE:
        raise ValueError(f"unknown gpu {gpu!r} for EKS; known: {sorted(GPU_TABLE)} (NAME[:COUNT])")
    try:
        n = int(count) if count else 1
    except ValueError:
        raise ValueError(f"gpu {gpu!r}: COUNT must be an integer, e.g. 'H100:8'") from None
    if n < 1:
        raise ValueError(f"gpu {gpu!r}: COUNT must be >= 1")
    return name, n


def parse_indexes(text: str | None) -> set[int]:
    """Kubernetes' index list ``"0-2,5"`` -> ``{0, 1, 2, 5}``."""
    out: set[int] = set()
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _is_404(exc: BaseException) -> bool:
    return getattr(exc, "status", None) == 404


class EKSExecutor:
    """Launch a DiLoCo run's replicas as one Indexed Job in ``namespace``."""

    backend_name = "eks"
    supports_inter_replica_network = True

    def __init__(
        self,
        image: str,
        *,
        namespace: str = "default",
        service_account_name: str | None = None,
        node_selector: dict[str, str] | None = None,
        tolerations: list[dict[str, Any]] | None = None,
        runtime_class_name: str | None = None,
        command: list[str] | None = None,
        cpu_request: str = "4",
        memory_request: str = "16Gi",
        ttl_seconds_after_finished: int = 3600,
        backoff_limit: int = 0,
        gpu_resource_key: str = "nvidia.com/gpu",
        run_id: str | None = None,
        batch_api: Any = None,
        core_api: Any = None,
        poll_interval_s: float = 10.0,
    ) -> None:
        if not image:
            raise ValueError("image is empty: pass the container image that has this package")
        self.image = image
        self.namespace = namespace
        self.service_account_name = service_account_name
        self.node_selector = dict(node_selector or {})
        self.tolerations = list(tolerations or [])
        self.runtime_class_name = runtime_class_name
        self.command = command
        self.cpu_request = cpu_request
        self.memory_request = memory_request
        self.ttl_seconds_after_finished = ttl_seconds_after_finished
        self.backoff_limit = backoff_limit
        self.gpu_resource_key = gpu_resource_key
        self.run_id = (run_id or uuid.uuid4().hex[:8]).lower()
        self._batch_api = batch_api
        self._core_api = core_api
        self.poll_interval_s = poll_interval_s

    # ------------------------------------------------------------------ clients

    def _apis(self) -> tuple[Any, Any]:
        if self._batch_api is None or self._core_api is None:
            kubernetes = import_sdk(
                "kubernetes",
                "EKSExecutor needs the kubernetes client: pip install "
                "'composer-replication[cloud]' (kubernetes)",
            )
            try:
                kubernetes.config.load_incluster_config()
            except kubernetes.config.ConfigException:
                kubernetes.config.load_kube_config()
            self._batch_api = self._batch_api or kubernetes.client.BatchV1Api()
            self._core_api = self._core_api or kubernetes.client.CoreV1Api()
        return self._batch_api, self._core_api

    # ------------------------------------------------------------------ the Job

    def job_name(self) -> str:
        return f"diloco-{self.run_id}"[:63].rstrip("-")

    def build_job(
        self,
        n_replicas: int,
        entrypoint: Any,
        entrypoint_args: dict[str, Any],
        *,
        gpu: str | None = None,
        timeout: int = 3600,
    ) -> Any:
        """The ``V1Job`` that ``launch_replicas`` submits (exposed to inspect or dry-run)."""
        from kubernetes import client

        spec, entrypoint_args = launch_spec(entrypoint, entrypoint_args, n_replicas)
        rank_env = str(entrypoint_args.get("rank_env", RANK_ENV))
        env = [
            client.V1EnvVar(
                name=rank_env,
                value_from=client.V1EnvVarSource(
                    field_ref=client.V1ObjectFieldSelector(
                        field_path=f"metadata.annotations['{INDEX_ANNOTATION}']"
                    )
                ),
            ),
            client.V1EnvVar(name=WORLD_SIZE_ENV, value=str(n_replicas)),
        ]
        reserved = {rank_env, WORLD_SIZE_ENV}
        env += [
            client.V1EnvVar(name=k, value=v)
            for k, v in sorted(scalar_env(entrypoint_args).items())
            if k not in reserved
        ]
        requests = {"cpu": self.cpu_request, "memory": self.memory_request}
        limits: dict[str, str] = {}
        node_selector = dict(self.node_selector)
        tolerations = [client.V1Toleration(**t) for t in self.tolerations]
        if gpu is not None:
            name, count = parse_gpu(gpu)
            limits[self.gpu_resource_key] = str(count)
            node_selector.setdefault(GPU_NODE_LABEL, GPU_TABLE[name])
            if not any(t.key == self.gpu_resource_key for t in tolerations):
                tolerations.append(
                    client.V1Toleration(
                        key=self.gpu_resource_key, operator="Exists", effect="NoSchedule"
                    )
                )
        labels = {"app.kubernetes.io/name": "composer-replication", "diloco-run-id": self.run_id}
        container = client.V1Container(
            name="replica",
            image=self.image,
            command=self.command or build_command(spec, entrypoint_args),
            env=env,
            resources=client.V1ResourceRequirements(requests=requests, limits=limits or None),
        )
        pod = client.V1PodSpec(
            restart_policy="Never",
            containers=[container],
            service_account_name=self.service_account_name,
            node_selector=node_selector or None,
            tolerations=tolerations or None,
            runtime_class_name=self.runtime_class_name,
        )
        return client.V1Job(
            api_version="batch/v1",
            kind="Job",
            metadata=client.V1ObjectMeta(
                name=self.job_name(), namespace=self.namespace, labels=labels
            ),
            spec=client.V1JobSpec(
                completion_mode="Indexed",
                completions=n_replicas,
                parallelism=n_replicas,
                backoff_limit=self.backoff_limit,
                active_deadline_seconds=int(timeout),
                ttl_seconds_after_finished=self.ttl_seconds_after_finished,
                template=client.V1PodTemplateSpec(
                    metadata=client.V1ObjectMeta(labels=labels), spec=pod
                ),
            ),
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
        job = self.build_job(n_replicas, entrypoint, entrypoint_args, gpu=gpu, timeout=timeout)
        batch_api, _ = self._apis()
        batch_api.create_namespaced_job(namespace=self.namespace, body=job)
        meta = {"job_name": self.job_name(), "namespace": self.namespace}
        return [
            ReplicaHandle(rank, self.backend_name, {**meta, "index": rank})
            for rank in range(n_replicas)
        ]

    # ------------------------------------------------------------------ tracking

    def _pod(self, handle: ReplicaHandle) -> Any | None:
        _, core_api = self._apis()
        selector = f"job-name={handle.metadata['job_name']},{INDEX_ANNOTATION}={handle.rank}"
        try:
            pods = core_api.list_namespaced_pod(
                namespace=handle.metadata["namespace"], label_selector=selector
            ).items
        except Exception as exc:
            if _is_404(exc):
                return None
            raise
        # the newest pod of this index (retries with backoff_limit > 0 create more)
        return max(pods, key=lambda p: str(p.metadata.creation_timestamp), default=None)

    def poll(self, handle: ReplicaHandle) -> ReplicaStatus:
        batch_api, _ = self._apis()
        try:
            job = batch_api.read_namespaced_job_status(
                name=handle.metadata["job_name"], namespace=handle.metadata["namespace"]
            )
        except Exception as exc:
            if _is_404(exc):
                return "cancelled"
            raise
        status = job.status
        if handle.rank in parse_indexes(getattr(status, "completed_indexes", None)):
            return "succeeded"
        if handle.rank in parse_indexes(getattr(status, "failed_indexes", None)):
            return "failed"
        for cond in getattr(status, "conditions", None) or []:
            if cond.type == "Failed" and cond.status == "True":
                return "failed"  # deadline exceeded or backoff limit: unfinished ranks failed
        pod = self._pod(handle)
        phase = getattr(getattr(pod, "status", None), "phase", None)
        return {"Running": "running", "Failed": "failed"}.get(phase or "", "pending")

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        pod = self._pod(handle)
        if pod is None:
            return ""
        _, core_api = self._apis()
        try:
            return core_api.read_namespaced_pod_log(
                name=pod.metadata.name, namespace=handle.metadata["namespace"], tail_lines=n_lines
            )
        except Exception as exc:
            if _is_404(exc):
                return ""
            raise

    def cancel(self, handle: ReplicaHandle) -> None:
        """Delete the whole Job (every rank) and its pods; an absent Job is fine."""
        batch_api, _ = self._apis()
        try:
            batch_api.delete_namespaced_job(
                name=handle.metadata["job_name"],
                namespace=handle.metadata["namespace"],
                propagation_policy="Background",
            )
        except Exception as exc:
            if not _is_404(exc):
                raise

    def collect(
        self, handles: list[ReplicaHandle], *, timeout: float | None = None
    ) -> list[dict[str, Any]]:
        def row(handle: ReplicaHandle, status: str) -> dict[str, Any]:
            pod = self._pod(handle) if status == "failed" else None
            code, error = None, None
            for cs in getattr(getattr(pod, "status", None), "container_statuses", None) or []:
                term = getattr(getattr(cs, "state", None), "terminated", None)
                if term is not None:
                    code, error = term.exit_code, term.message or term.reason
            if status == "succeeded":
                code = 0
            if status == "failed" and error is None:
                error = "replica failed (job failed, deadline exceeded or pod error)"
            return {
                "exit_code": code,
                "error": error,
                "job_name": handle.metadata["job_name"],
                "namespace": handle.metadata["namespace"],
            }

        return collect_by_polling(self, handles, timeout, self.poll_interval_s, row)
