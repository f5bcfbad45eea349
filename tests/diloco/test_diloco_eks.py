"""EKSExecutor against injected BatchV1Api/CoreV1Api objects: the exact Job it submits,
the per-rank status mapping, logs, and cancel (background propagation, 404 tolerated)."""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

import pytest

pytest.importorskip("kubernetes")
from kubernetes.client import ApiClient
from kubernetes.client.rest import ApiException

from composer_replication.diloco.serverless import ServerlessExecutor
from composer_replication.diloco.serverless.eks import EKSExecutor, parse_indexes


class FakeBatch:
    def __init__(self) -> None:
        self.created: list[tuple[str, Any]] = []
        self.deleted: list[dict[str, Any]] = []
        self.status: Any = NS(completed_indexes=None, failed_indexes=None, conditions=None)
        self.missing = False

    def create_namespaced_job(self, namespace: str, body: Any) -> Any:
        self.created.append((namespace, body))
        return body

    def read_namespaced_job_status(self, name: str, namespace: str) -> Any:
        if self.missing:
            raise ApiException(status=404, reason="Not Found")
        return NS(status=self.status)

    def delete_namespaced_job(self, **kwargs: Any) -> None:
        self.deleted.append(kwargs)
        if self.missing:
            raise ApiException(status=404, reason="Not Found")


class FakeCore:
    def __init__(self) -> None:
        self.pods: dict[int, Any] = {}
        self.selectors: list[str] = []

    def list_namespaced_pod(self, namespace: str, label_selector: str) -> Any:
        self.selectors.append(label_selector)
        index = int(label_selector.rsplit("=", 1)[1])
        return NS(items=[self.pods[index]] if index in self.pods else [])

    def read_namespaced_pod_log(self, name: str, namespace: str, tail_lines: int) -> str:
        return f"log of {name} ({tail_lines} lines)"


def make(**kwargs: Any) -> tuple[EKSExecutor, FakeBatch, FakeCore]:
    batch, core = FakeBatch(), FakeCore()
    ex = EKSExecutor(
        "ghcr.io/me/composer:1", run_id="abc123", batch_api=batch, core_api=core, **kwargs
    )
    return ex, batch, core


def test_indexed_job_spec_is_exact() -> None:
    ex, batch, _ = make(namespace="ml", service_account_name="trainer", cpu_request="8")
    assert isinstance(ex, ServerlessExecutor)
    args = {"rendezvous_uri": "s3://b/run", "world_size": 4, "lr": 0.5, "tags": ["x"]}
    handles = ex.launch_replicas(4, "my.train", args, gpu="H100:8", timeout=7200)
    assert [(h.rank, h.metadata) for h in handles] == [
        (r, {"job_name": "diloco-abc123", "namespace": "ml", "index": r}) for r in range(4)
    ]
    [(namespace, job)] = batch.created
    body = ApiClient().sanitize_for_serialization(job)
    spec = body["spec"]
    assert namespace == "ml"
    assert body["metadata"]["name"] == "diloco-abc123"
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 4, 4)
    assert spec["activeDeadlineSeconds"] == 7200
    assert spec["backoffLimit"] == 0 and spec["ttlSecondsAfterFinished"] == 3600
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["serviceAccountName"] == "trainer"
    assert pod["nodeSelector"] == {"karpenter.k8s.aws/instance-gpu-name": "h100"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    [container] = pod["containers"]
    assert container["resources"] == {
        "requests": {"cpu": "8", "memory": "16Gi"},
        "limits": {"nvidia.com/gpu": "8"},
    }
    assert container["env"] == [
        {
            "name": "REPLICA_RANK",
            "valueFrom": {
                "fieldRef": {
                    "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
                }
            },
        },
        {"name": "REPLICA_WORLD_SIZE", "value": "4"},
        {"name": "LR", "value": "0.5"},
        {"name": "RENDEZVOUS_URI", "value": "s3://b/run"},
        {"name": "WORLD_SIZE", "value": "4"},
    ]  # the list-valued "tags" travels only in the --args-json command argument
    assert container["command"][:5] == [
        "python",
        "-m",
        "composer_replication.diloco.serverless.runner",
        "--entrypoint",
        "my.train",
    ]


@pytest.mark.parametrize(("gpu", "label"), [("A100", "a100"), ("a10g", "a10g"), ("T4", "t4")])
def test_gpu_table(gpu: str, label: str) -> None:
    ex, batch, _ = make()
    ex.launch_replicas(1, "m", {}, gpu=gpu)
    pod = ApiClient().sanitize_for_serialization(batch.created[0][1])["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"karpenter.k8s.aws/instance-gpu-name": label}
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}


def test_cpu_job_has_no_gpu_limits_and_unknown_gpu_is_rejected() -> None:
    ex, batch, _ = make()
    ex.launch_replicas(2, "m", {})
    pod = ApiClient().sanitize_for_serialization(batch.created[0][1])["spec"]["template"]["spec"]
    assert "limits" not in pod["containers"][0]["resources"]
    assert "nodeSelector" not in pod and "tolerations" not in pod
    with pytest.raises(ValueError, match="unknown gpu 'V100'"):
        ex.launch_replicas(1, "m", {}, gpu="V100")


def test_status_mapping_per_rank() -> None:
    ex, batch, core = make()
    handles = ex.launch_replicas(5, "m", {})
    batch.status = NS(completed_indexes="0,2-3", failed_indexes="4", conditions=None)
    core.pods[1] = NS(metadata=NS(name="p1", creation_timestamp="t"), status=NS(phase="Running"))
    assert [ex.poll(h) for h in handles] == [
        "succeeded",
        "running",
        "succeeded",
        "succeeded",
        "failed",
    ]
    assert core.selectors[-1] == "job-name=diloco-abc123,batch.kubernetes.io/job-completion-index=1"
    core.pods.clear()
    batch.status = NS(completed_indexes="", failed_indexes=None, conditions=None)
    assert ex.poll(handles[1]) == "pending"  # no pod scheduled yet
    batch.status = NS(
        completed_indexes="0",
        failed_indexes=None,
        conditions=[NS(type="Failed", status="True", reason="DeadlineExceeded")],
    )
    assert [ex.poll(h) for h in handles[:2]] == ["succeeded", "failed"]
    batch.missing = True
    assert ex.poll(handles[0]) == "cancelled"  # deleted (or TTL-collected): 404 tolerated


def test_logs_and_cancel() -> None:
    ex, batch, core = make()
    handles = ex.launch_replicas(2, "m", {})
    assert ex.stream_logs(handles[0]) == ""  # no pod yet
    core.pods[0] = NS(metadata=NS(name="pod-0", creation_timestamp="t"), status=NS(phase="Running"))
    assert ex.stream_logs(handles[0], n_lines=7) == "log of pod-0 (7 lines)"
    ex.cancel(handles[0])
    assert batch.deleted == [
        {"name": "diloco-abc123", "namespace": "default", "propagation_policy": "Background"}
    ]
    batch.missing = True
    ex.cancel(handles[1])  # already gone: no error


def test_parse_indexes() -> None:
    assert parse_indexes("0-2,5,7-8") == {0, 1, 2, 5, 7, 8}
    assert parse_indexes(None) == set() and parse_indexes("") == set()


def test_documented_example_with_the_default_entrypoint() -> None:
    batch, core = FakeBatch(), FakeCore()
    ex = EKSExecutor(
        image="ghcr.io/me/diloco:latest",
        service_account_name="diloco-s3",
        batch_api=batch,
        core_api=core,
    )
    handles = ex.launch_replicas(
        n_replicas=4,
        entrypoint="",  # ignored on k8s
        entrypoint_args={
            "rendezvous_uri": "s3://bucket/run/",
            "trainer_module": "my.trainer",
            "world_size": 4,
        },
        gpu="H100",
    )
    assert [h.rank for h in handles] == [0, 1, 2, 3]
    ((_, job),) = batch.created
    command = job.spec.template.spec.containers[0].command
    assert command[command.index("--entrypoint") + 1] == (
        "composer_replication.diloco.serverless.replica_entrypoint"
    )
    batch.status = NS(completed_indexes="0-3", failed_indexes=None, conditions=None)
    results = ex.collect(handles, timeout=3600)
    assert [(r["rank"], r["status"], r["exit_code"]) for r in results] == [
        (r, "succeeded", 0) for r in range(4)
    ]
    # the default entry point needs its rendezvous and trainer, before anything is created
    with pytest.raises(ValueError, match=r"lacks \['trainer_module'\]"):
        ex.launch_replicas(2, "", {"rendezvous_uri": "s3://bucket/run/"})
    assert len(batch.created) == 1
