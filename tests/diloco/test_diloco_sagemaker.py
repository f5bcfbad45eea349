"""SageMakerExecutor against moto's SageMaker and CloudWatch Logs (a real AWS API on
loopback), plus injected clients for what moto lacks (StopTrainingJob, live statuses)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

boto3 = pytest.importorskip("boto3")

from composer_replication.diloco.serverless import ServerlessExecutor  # noqa: E402
from composer_replication.diloco.serverless.sagemaker import SageMakerExecutor  # noqa: E402

ROLE = "arn:aws:iam::123456789012:role/sagemaker"


def executor(endpoint: str, **kwargs: Any) -> tuple[SageMakerExecutor, list[dict[str, Any]]]:
    sm = boto3.client("sagemaker", endpoint_url=endpoint, region_name="us-east-1")
    logs = boto3.client("logs", endpoint_url=endpoint, region_name="us-east-1")
    sent: list[dict[str, Any]] = []
    # record the exact parameters botocore sends (moto drops some, e.g. Environment)
    sm.meta.events.register(
        "provide-client-params.sagemaker.CreateTrainingJob",
        lambda params, **_: sent.append(json.loads(json.dumps(params))),
    )
    ex = SageMakerExecutor(
        role_arn=ROLE,
        image_uri="123.dkr.ecr.us-east-1.amazonaws.com/composer:1",
        output_s3_path="s3://out/diloco",
        sagemaker_client=sm,
        logs_client=logs,
        poll_interval_s=0.01,
        **kwargs,
    )
    return ex, sent


def test_launch_describe_list_and_logs_on_moto(aws_env: str) -> None:
    run = f"r{int(time.time() * 1000) % 10**8}"
    ex, sent = executor(aws_env, run_id=run)
    assert isinstance(ex, ServerlessExecutor)
    args = {"rendezvous_uri": "s3://b/run", "world_size": 3, "trainer_module": "my.train"}
    handles = ex.launch_replicas(
        3,
        "composer_replication.diloco.serverless.replica_entrypoint",
        args,
        gpu="A100",
        timeout=5400,
    )
    names = [h.metadata["job_name"] for h in handles]
    assert names == [f"diloco-{run}-r{r}" for r in range(3)]
    listed = ex._client("sagemaker").list_training_jobs(NameContains=run)["TrainingJobSummaries"]
    assert sorted(j["TrainingJobName"] for j in listed) == names
    described = ex._describe(handles[1])
    assert described["ResourceConfig"] == {
        "InstanceType": "ml.p4d.24xlarge",
        "InstanceCount": 1,
        "VolumeSizeInGB": 100,
    }
    assert described["StoppingCondition"] == {"MaxRuntimeInSeconds": 5400}
    assert described["EnableNetworkIsolation"] is False
    env = sent[1]["Environment"]
    assert env["REPLICA_RANK"] == "1" and env["REPLICA_WORLD_SIZE"] == "3"
    assert env["RENDEZVOUS_URI"] == "s3://b/run" and env["TRAINER_MODULE"] == "my.train"
    assert json.loads(env["DILOCO_ARGS_JSON"]) == args
    spec = sent[1]["AlgorithmSpecification"]
    assert spec["ContainerEntrypoint"] == ["python"]
    assert spec["ContainerArguments"][-2:] == [
        "--entrypoint",
        "composer_replication.diloco.serverless.replica_entrypoint",
    ]
    assert all(p["EnableNetworkIsolation"] is False for p in sent)
    # moto completes training jobs at once
    assert [ex.poll(h) for h in handles] == ["succeeded"] * 3
    rows = ex.collect(handles, timeout=5)
    assert [(r["rank"], r["status"], r["exit_code"]) for r in rows] == [
        (0, "succeeded", 0),
        (1, "succeeded", 0),
        (2, "succeeded", 0),
    ]
    logs = ex._client("logs")
    assert ex.stream_logs(handles[0]) == ""  # no log group yet
    logs.create_log_group(logGroupName="/aws/sagemaker/TrainingJobs")
    stream = f"{names[0]}/algo-1-1700000000"
    logs.create_log_stream(logGroupName="/aws/sagemaker/TrainingJobs", logStreamName=stream)
    now = int(time.time() * 1000)
    logs.put_log_events(
        logGroupName="/aws/sagemaker/TrainingJobs",
        logStreamName=stream,
        logEvents=[{"timestamp": now + i, "message": f"line {i}"} for i in range(5)],
    )
    assert ex.stream_logs(handles[0], n_lines=2) == "line 3\nline 4"


@pytest.mark.parametrize(
    ("gpu", "instance"),
    [
        (None, "ml.m5.xlarge"),
        ("auto", "ml.g5.2xlarge"),
        ("H100", "ml.p5.48xlarge"),
        ("h200", "ml.p5e.48xlarge"),
        ("B200", "ml.p6-b200.48xlarge"),
        ("L40S", "ml.g6e.xlarge"),
        ("A10G", "ml.g5.2xlarge"),
        ("L4", "ml.g6.xlarge"),
        ("ml.trn1.32xlarge", "ml.trn1.32xlarge"),
    ],
)
def test_gpu_to_instance(gpu: str | None, instance: str) -> None:
    ex = SageMakerExecutor(role_arn=ROLE, image_uri="i", output_s3_path="s3://o")
    assert ex.resolve_instance_type(gpu) == instance


def test_unknown_gpu_and_bad_output_path() -> None:
    ex = SageMakerExecutor(role_arn=ROLE, image_uri="i", output_s3_path="s3://o")
    with pytest.raises(ValueError, match="unknown gpu 'V100'"):
        ex.resolve_instance_type("V100")
    with pytest.raises(ValueError, match="s3://"):
        SageMakerExecutor(role_arn=ROLE, image_uri="i", output_s3_path="/local")


class FakeSageMaker:
    """What moto lacks: StopTrainingJob, in-progress statuses, a failing create."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.created: list[str] = []
        self.stopped: list[str] = []
        self.jobs: dict[str, dict[str, Any]] = {}

    def create_training_job(self, **request: Any) -> dict[str, str]:
        if len(self.created) == self.fail_at:
            raise RuntimeError("ResourceLimitExceeded: no ml.p5.48xlarge capacity")
        self.created.append(request["TrainingJobName"])
        return {"TrainingJobArn": f"arn:...:{request['TrainingJobName']}"}

    def stop_training_job(self, TrainingJobName: str) -> None:
        if self.jobs.get(TrainingJobName, {}).get("TrainingJobStatus") == "Completed":
            raise RuntimeError("ValidationException: job is not in progress")
        self.stopped.append(TrainingJobName)

    def describe_training_job(self, TrainingJobName: str) -> dict[str, Any]:
        return self.jobs[TrainingJobName]


def test_partial_launch_failure_stops_launched_siblings() -> None:
    sm = FakeSageMaker(fail_at=2)
    ex = SageMakerExecutor(
        role_arn=ROLE, image_uri="i", output_s3_path="s3://o", run_id="x", sagemaker_client=sm
    )
    with pytest.raises(RuntimeError, match=r"rank 2 .* failed: ResourceLimitExceeded"):
        ex.launch_replicas(4, "m", {}, gpu="H100")
    assert sm.stopped == ["diloco-x-r0", "diloco-x-r1"]


def test_status_map_and_cancel() -> None:
    sm = FakeSageMaker()
    ex = SageMakerExecutor(
        role_arn=ROLE, image_uri="i", output_s3_path="s3://o", run_id="x", sagemaker_client=sm
    )
    [h] = ex.launch_replicas(1, "m", {})
    cases = [
        ({"TrainingJobStatus": "InProgress", "SecondaryStatus": "Starting"}, "pending"),
        ({"TrainingJobStatus": "InProgress", "SecondaryStatus": "Downloading"}, "pending"),
        ({"TrainingJobStatus": "InProgress", "SecondaryStatus": "Training"}, "running"),
        ({"TrainingJobStatus": "Completed"}, "succeeded"),
        ({"TrainingJobStatus": "Failed", "FailureReason": "OOM"}, "failed"),
        ({"TrainingJobStatus": "Stopping"}, "cancelled"),
        ({"TrainingJobStatus": "Stopped"}, "cancelled"),
    ]
    for job, expected in cases:
        sm.jobs["diloco-x-r0"] = job
        assert ex.poll(h) == expected, job
    sm.jobs["diloco-x-r0"] = {"TrainingJobStatus": "Failed", "FailureReason": "OOM"}
    assert ex.collect([h])[0]["error"] == "OOM"
    sm.jobs["diloco-x-r0"] = {"TrainingJobStatus": "InProgress"}
    ex.cancel(h)
    assert sm.stopped == ["diloco-x-r0"]
    sm.jobs["diloco-x-r0"] = {"TrainingJobStatus": "Completed"}
    ex.cancel(h)  # already finished: tolerated


def test_env_values_over_the_sagemaker_cap_are_refused() -> None:
    ex = SageMakerExecutor(role_arn=ROLE, image_uri="i", output_s3_path="s3://o")
    with pytest.raises(ValueError, match="512 characters"):
        ex.training_job_request(0, 1, "m", {"config": "x" * 600})


def test_documented_example_default_entrypoint_and_collect_rows(aws_env: str) -> None:
    run = f"d{int(time.time() * 1000) % 10**8}"
    sm = boto3.client("sagemaker", endpoint_url=aws_env, region_name="us-east-1")
    sent: list[dict[str, Any]] = []
    sm.meta.events.register(
        "provide-client-params.sagemaker.CreateTrainingJob",
        lambda params, **_: sent.append(json.loads(json.dumps(params))),
    )
    ex = SageMakerExecutor(
        role_arn="arn:aws:iam::123:role/sm-exec",
        image_uri="123.dkr.ecr.us-east-1.amazonaws.com/diloco:latest",
        output_s3_path="s3://bucket/out/",
        region="us-east-1",
        run_id=run,
        sagemaker_client=sm,
        poll_interval_s=0.01,
    )
    handles = ex.launch_replicas(
        n_replicas=2,
        entrypoint="",
        entrypoint_args={"rendezvous_uri": "s3://bucket/run/", "trainer_module": "my.trainer"},
        gpu="A100",
    )
    spec = sent[0]["AlgorithmSpecification"]
    assert spec["ContainerArguments"][-2:] == [
        "--entrypoint",
        "composer_replication.diloco.serverless.replica_entrypoint",
    ]
    # the default entry point gets world_size = n_replicas
    assert json.loads(sent[1]["Environment"]["DILOCO_ARGS_JSON"])["world_size"] == 2
    results = ex.collect(handles)
    assert [r["training_job_name"] for r in results] == [f"diloco-{run}-r0", f"diloco-{run}-r1"]
    for row in results:
        described = ex._client("sagemaker").describe_training_job(
            TrainingJobName=row["training_job_name"]
        )
        assert row["result"] == described["ModelArtifacts"]["S3ModelArtifacts"]
        assert row["result"].startswith("s3://bucket/out/")
        assert {"rank", "status", "exit_code", "error", "result", "training_job_name"} <= set(row)
    with pytest.raises(ValueError, match=r"lacks \['rendezvous_uri'\]"):
        ex.launch_replicas(1, "", {"trainer_module": "my.trainer"})
