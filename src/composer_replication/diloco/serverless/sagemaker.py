"""``SageMakerExecutor``: one single-instance SageMaker training job per replica.

SageMaker has no "N ranks of one job" for independent containers that meet through S3,
so each rank is its own training job ``diloco-<run_id>-r<rank>`` with ``REPLICA_RANK`` and
``REPLICA_WORLD_SIZE`` (plus scalar ``entrypoint_args``, upper-cased) in its
``Environment``. ``EnableNetworkIsolation`` is always False: the replicas must reach the
S3 rendezvous. ``gpu`` picks the instance (``GPU_INSTANCES``; a literal ``ml.*`` passes
through; ``"auto"`` = ``instance_type``; ``None`` = ``cpu_instance_type``), ``timeout`` is
``MaxRuntimeInSeconds``. If launching rank k fails, ranks 0..k-1 are stopped before the
error is raised: a partial DiLoCo run would only wait for peers that never come. Logs come
from CloudWatch (``/aws/sagemaker/TrainingJobs``). boto3 is imported lazily; both clients
are injectable.
"""

from __future__ import annotations

import json
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
    launch_one_by_one,
    launch_spec,
    scalar_env,
)
from composer_replication.diloco.serverless.runner import ARGS_ENV, build_command

GPU_INSTANCES: dict[str, str] = {
    "A100": "ml.p4d.24xlarge",
    "H100": "ml.p5.48xlarge",
    "H200": "ml.p5e.48xlarge",
    "B200": "ml.p6-b200.48xlarge",
    "L40S": "ml.g6e.xlarge",
    "A10G": "ml.g5.2xlarge",
    "L4": "ml.g6.xlarge",
}
LOG_GROUP = "/aws/sagemaker/TrainingJobs"
# SecondaryStatus values of an InProgress job that has not started the container yet
_QUEUED = {"Starting", "Pending", "LaunchingMLInstances", "PreparingTrainingStack", "Downloading"}
_STATUS: dict[str, ReplicaStatus] = {
    "Completed": "succeeded",
    "Failed": "failed",
    "Stopping": "cancelled",
    "Stopped": "cancelled",
}


class SageMakerExecutor:
    """Launch each replica as a SageMaker training job running this package's runner."""

    backend_name = "sagemaker"
    supports_inter_replica_network = False

    def __init__(
        self,
        *,
        role_arn: str,
        image_uri: str,
        output_s3_path: str,
        instance_type: str = "ml.g5.2xlarge",
        cpu_instance_type: str = "ml.m5.xlarge",
        volume_size_gb: int = 100,
        run_id: str | None = None,
        region: str | None = None,
        sagemaker_client: Any = None,
        logs_client: Any = None,
        poll_interval_s: float = 30.0,
    ) -> None:
        if not output_s3_path.startswith("s3://"):
            raise ValueError(f"output_s3_path must be an s3:// URI, got {output_s3_path!r}")
        self.role_arn = role_arn
        self.image_uri = image_uri
        self.output_s3_path = output_s3_path
        self.instance_type = instance_type
        self.cpu_instance_type = cpu_instance_type
        self.volume_size_gb = volume_size_gb
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.region = region
        self._sm = sagemaker_client
        self._logs = logs_client
        self.poll_interval_s = poll_interval_s

    def _client(self, service: str) -> Any:
        current = self._sm if service == "sagemaker" else self._logs
        if current is not None:
            return current
        boto3 = import_sdk(
            "boto3", "SageMakerExecutor needs boto3: pip install 'composer-replication[cloud]'"
        )
        made = boto3.client(service, region_name=self.region)
        if service == "sagemaker":
            self._sm = made
        else:
            self._logs = made
        return made

    def resolve_instance_type(self, gpu: str | None) -> str:
        if gpu is None:
            return self.cpu_instance_type
        if gpu.startswith("ml."):
            return gpu
        if gpu.lower() == "auto":
            return self.instance_type
        key = gpu.strip().upper()
        if key not in GPU_INSTANCES:
            raise ValueError(
                f"unknown gpu {gpu!r} for SageMaker; known: {sorted(GPU_INSTANCES)}, 'auto' "
                "(instance_type) or a literal 'ml.*' instance type"
            )
        return GPU_INSTANCES[key]

    def job_name(self, rank: int) -> str:
        return f"diloco-{self.run_id}-r{rank}"[:63]

    def training_job_request(
        self,
        rank: int,
        n_replicas: int,
        entrypoint: Any,
        entrypoint_args: dict[str, Any],
        *,
        gpu: str | None = None,
        timeout: int = 3600,
    ) -> dict[str, Any]:
        """The ``CreateTrainingJob`` parameters for one rank."""
        spec, entrypoint_args = launch_spec(entrypoint, entrypoint_args, n_replicas)
        rank_env = str(entrypoint_args.get("rank_env", RANK_ENV))
        env = scalar_env(entrypoint_args)
        env.update({rank_env: str(rank), WORLD_SIZE_ENV: str(n_replicas)})
        # SageMaker caps a container argument at 256 and an env value at 512 characters:
        # the arguments travel as JSON in DILOCO_ARGS_JSON, not on the command line
        env[ARGS_ENV] = json.dumps(entrypoint_args, sort_keys=True)
        too_long = sorted(k for k, v in env.items() if len(v) > 512)
        if too_long:
            raise ValueError(
                f"SageMaker environment values are capped at 512 characters; {too_long} are "
                "longer: pass large inputs by URI (e.g. a config uploaded to S3)"
            )
        command = build_command(spec, {})[:-2]  # no --args-json
        return {
            "TrainingJobName": self.job_name(rank),
            "RoleArn": self.role_arn,
            "AlgorithmSpecification": {
                "TrainingImage": self.image_uri,
                "TrainingInputMode": "File",
                "ContainerEntrypoint": command[:1],
                "ContainerArguments": command[1:],
            },
            "OutputDataConfig": {"S3OutputPath": self.output_s3_path},
            "ResourceConfig": {
                "InstanceType": self.resolve_instance_type(gpu),
                "InstanceCount": 1,
                "VolumeSizeInGB": self.volume_size_gb,
            },
            "StoppingCondition": {"MaxRuntimeInSeconds": int(timeout)},
            "Environment": env,
            "EnableNetworkIsolation": False,
            "Tags": [{"Key": "diloco-run-id", "Value": self.run_id}],
        }

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
        requests = [
            self.training_job_request(
                rank, n_replicas, entrypoint, entrypoint_args, gpu=gpu, timeout=timeout
            )
            for rank in range(n_replicas)
        ]
        sm = self._client("sagemaker")

        def start_rank(rank: int) -> dict[str, Any]:
            response = sm.create_training_job(**requests[rank])
            return {
                "job_name": requests[rank]["TrainingJobName"],
                "arn": response["TrainingJobArn"],
            }

        return launch_one_by_one(
            self,
            n_replicas,
            start_rank,
            lambda rank, exc: (
                f"SageMaker launch of rank {rank} "
                f"({requests[rank]['TrainingJobName']}) failed: {exc}; stopped the {rank} replicas "
                "already launched"
            ),
        )

    def _describe(self, handle: ReplicaHandle) -> dict[str, Any]:
        return self._client("sagemaker").describe_training_job(
            TrainingJobName=handle.metadata["job_name"]
        )

    def poll(self, handle: ReplicaHandle) -> ReplicaStatus:
        job = self._describe(handle)
        status = job["TrainingJobStatus"]
        if status == "InProgress":
            return "pending" if job.get("SecondaryStatus") in _QUEUED else "running"
        return _STATUS.get(status, "pending")

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        logs = self._client("logs")
        name = handle.metadata["job_name"]
        try:
            streams = logs.describe_log_streams(
                logGroupName=LOG_GROUP, logStreamNamePrefix=f"{name}/"
            ).get("logStreams", [])
            lines: list[str] = []
            for stream in streams:
                events = logs.get_log_events(
                    logGroupName=LOG_GROUP,
                    logStreamName=stream["logStreamName"],
                    limit=n_lines,
                    startFromHead=False,
                )["events"]
                lines += [e["message"] for e in events]
        except Exception as exc:
            if "ResourceNotFound" in type(exc).__name__ or "ResourceNotFound" in str(exc):
                return ""  # no log group/stream yet: the job has not started
            raise
        return "\n".join(lines[-n_lines:])

    def cancel(self, handle: ReplicaHandle) -> None:
        """Stop the rank's training job; a job that already ended is left as it is."""
        try:
            self._client("sagemaker").stop_training_job(TrainingJobName=handle.metadata["job_name"])
        except Exception as exc:
            text = str(exc)
            if "ValidationException" in text or "ResourceNotFound" in text:
                return  # finished or unknown: nothing to stop
            raise

    def collect(
        self, handles: list[ReplicaHandle], *, timeout: float | None = None
    ) -> list[dict[str, Any]]:
        def row(handle: ReplicaHandle, status: str) -> dict[str, Any]:
            job = self._describe(handle)
            return {
                "exit_code": 0 if status == "succeeded" else None,
                "error": job.get("FailureReason"),
                "result": (job.get("ModelArtifacts") or {}).get("S3ModelArtifacts"),
                "training_job_name": handle.metadata["job_name"],
                "job_name": handle.metadata["job_name"],
                "arn": handle.metadata["arn"],
                "secondary_status": job.get("SecondaryStatus"),
            }

        return collect_by_polling(self, handles, timeout, self.poll_interval_s, row)
