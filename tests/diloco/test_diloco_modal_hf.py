"""ModalExecutor and HFJobsExecutor against injected clients shaped like their SDKs
(modal's Function/FunctionCall, huggingface_hub's HfApi jobs methods)."""

from __future__ import annotations

import os
from types import SimpleNamespace as NS
from typing import Any, ClassVar

import pytest

from composer_replication.diloco.serverless import ServerlessExecutor
from composer_replication.diloco.serverless.hf_jobs import HFJobsExecutor
from composer_replication.diloco.serverless.modal import ModalExecutor, modal_replica


class FakeCall:
    registry: ClassVar[dict[str, FakeCall]] = {}

    def __init__(self, call_id: str, kwargs: dict[str, Any]) -> None:
        self.object_id, self.kwargs = call_id, kwargs
        self.status, self.cancelled, self.result = "PENDING", False, None
        self.logs = NS(tail=lambda n: [NS(message=f"{call_id} line {i}\n") for i in range(3)][-n:])
        FakeCall.registry[call_id] = self

    def get_call_graph(self) -> list[Any]:
        return [NS(status=NS(name=self.status))]

    def cancel(self, terminate_containers: bool = False) -> None:
        self.cancelled = terminate_containers
        self.status = "TERMINATED"

    def get(self, timeout: float | None = None) -> Any:
        if self.status == "FAILURE":
            raise RuntimeError("replica crashed")
        return self.result


class FakeFunction:
    def __init__(self, fail_at: int | None = None) -> None:
        self.options: dict[str, Any] = {}
        self.spawned: list[FakeCall] = []
        self.fail_at = fail_at

    def with_options(self, **options: Any) -> FakeFunction:
        self.options = options
        return self

    def spawn(self, **kwargs: Any) -> FakeCall:
        if len(self.spawned) == self.fail_at:
            raise RuntimeError("quota")
        call = FakeCall(f"fc-{len(self.spawned)}", kwargs)
        self.spawned.append(call)
        return call


def fake_modal(function: FakeFunction) -> Any:
    looked_up: list[tuple] = []

    def from_name(app: str, name: str, *, environment_name: str | None = None) -> FakeFunction:
        looked_up.append((app, name, environment_name))
        return function

    return NS(
        Function=NS(from_name=from_name),
        FunctionCall=NS(from_id=lambda call_id: FakeCall.registry[call_id]),
        looked_up=looked_up,
    )


def test_modal_spawns_one_call_per_rank() -> None:
    fn = FakeFunction()
    sdk = fake_modal(fn)
    ex = ModalExecutor("composer-diloco", "replica", environment_name="dev", modal_module=sdk)
    assert isinstance(ex, ServerlessExecutor) and not ex.supports_inter_replica_network
    args = {"rendezvous_uri": "s3://b/r", "world_size": 2}
    handles = ex.launch_replicas(2, "my.train", args, gpu="H100:8", timeout=900)
    assert sdk.looked_up == [("composer-diloco", "replica", "dev")]
    assert fn.options == {"timeout": 900, "gpu": "H100:8"}
    assert [c.kwargs for c in fn.spawned] == [
        {"rank": r, "world_size": 2, "entrypoint": "my.train", "entrypoint_args": args}
        for r in range(2)
    ]
    assert [h.metadata["call_id"] for h in handles] == ["fc-0", "fc-1"]
    statuses = {
        "PENDING": "running",
        "SUCCESS": "succeeded",
        "FAILURE": "failed",
        "INIT_FAILURE": "failed",
        "TIMEOUT": "failed",
        "TERMINATED": "cancelled",
    }
    for modal_status, ours in statuses.items():
        fn.spawned[0].status = modal_status
        assert ex.poll(handles[0]) == ours
    assert ex.stream_logs(handles[1], n_lines=2) == "fc-1 line 1\nfc-1 line 2"
    ex.cancel(handles[1])
    assert fn.spawned[1].cancelled is True
    fn.spawned[0].status = "FAILURE"
    rows = ex.collect(handles)
    assert rows[0]["status"] == "failed" and "replica crashed" in rows[0]["error"]
    assert rows[1]["status"] == "cancelled"


def test_modal_partial_spawn_failure_cancels_siblings() -> None:
    fn = FakeFunction(fail_at=1)
    ex = ModalExecutor("a", modal_module=fake_modal(fn))
    with pytest.raises(RuntimeError) as raised:
        ex.launch_replicas(3, "my.train", {})
    assert str(raised.value) == (
        "Modal spawn of rank 1 failed: quota; cancelled the 1 replicas already spawned"
    )
    assert fn.spawned[0].status == "TERMINATED"


def test_modal_replica_sets_rank_and_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REPLICA_RANK", raising=False)
    assert modal_replica(3, 4, "os.getenv", {"key": "REPLICA_RANK"}) == "3"
    assert os.environ["REPLICA_WORLD_SIZE"] == "4"


class FakeHfApi:
    def __init__(self) -> None:
        self.runs: list[dict[str, Any]] = []
        self.stages: dict[str, str] = {}
        self.cancelled: list[str] = []

    def run_job(self, **kwargs: Any) -> Any:
        job_id = f"job{len(self.runs)}"
        self.runs.append(kwargs)
        self.stages[job_id] = "SCHEDULING"
        return NS(id=job_id, url=f"https://hf.co/jobs/me/{job_id}")

    def inspect_job(self, *, job_id: str, namespace: str | None = None) -> Any:
        return NS(status=NS(stage=self.stages[job_id], message="exit 137"))

    def fetch_job_logs(self, *, job_id: str, namespace: str | None, follow: bool) -> Any:
        return iter([f"{job_id} a", f"{job_id} b", f"{job_id} c"])

    def cancel_job(self, *, job_id: str, namespace: str | None = None) -> None:
        self.cancelled.append(job_id)
        self.stages[job_id] = "CANCELED"


def test_hf_jobs_one_job_per_rank() -> None:
    api = FakeHfApi()
    ex = HFJobsExecutor("ghcr.io/me/img:1", namespace="me", secrets={"HF_TOKEN": "t"}, api=api)
    assert isinstance(ex, ServerlessExecutor)
    args = {"rendezvous_uri": "hf://buckets/me/rdv", "world_size": 2}
    handles = ex.launch_replicas(2, "my.train", args, gpu="A100", timeout=3000)
    assert [r["env"] for r in api.runs] == [
        {
            "RENDEZVOUS_URI": "hf://buckets/me/rdv",
            "WORLD_SIZE": "2",
            "REPLICA_RANK": str(r),
            "REPLICA_WORLD_SIZE": "2",
        }
        for r in range(2)
    ]
    first = api.runs[0]
    assert (first["flavor"], first["timeout"], first["namespace"]) == ("a100-large", 3000, "me")
    assert first["secrets"] == {"HF_TOKEN": "t"} and first["image"] == "ghcr.io/me/img:1"
    assert first["command"][:3] == ["python", "-m", "composer_replication.diloco.serverless.runner"]
    for stage, ours in [
        ("SCHEDULING", "pending"),
        ("RUNNING", "running"),
        ("COMPLETED", "succeeded"),
        ("ERROR", "failed"),
        ("CANCELED", "cancelled"),
        ("DELETED", "cancelled"),
    ]:
        api.stages["job0"] = stage
        assert ex.poll(handles[0]) == ours
    assert ex.stream_logs(handles[1], n_lines=2) == "job1 b\njob1 c"
    ex.cancel(handles[1])
    assert api.cancelled == ["job1"]
    api.stages["job0"] = "ERROR"
    row = ex.collect(handles)[0]
    assert row["error"] == "exit 137"
    # the protocol's keys first, then the backend's own
    assert list(row) == ["rank", "status", "exit_code", "error", "job_id", "url"]


class FlakyHfApi(FakeHfApi):
    """Refuses the third launch; cancelling job0 fails (the Hub is unreachable)."""

    def run_job(self, **kwargs: Any) -> Any:
        if len(self.runs) == 2:
            raise RuntimeError("quota exceeded")
        return super().run_job(**kwargs)

    def cancel_job(self, *, job_id: str, namespace: str | None = None) -> None:
        if job_id == "job0":
            raise ConnectionError("hub unreachable")
        super().cancel_job(job_id=job_id, namespace=namespace)


def test_hf_jobs_partial_launch_failure_cancels_every_launched_rank() -> None:
    api = FlakyHfApi()
    ex = HFJobsExecutor("img", api=api)
    with pytest.raises(RuntimeError) as raised:
        ex.launch_replicas(3, "my.train", {})
    # the launch error is the one reported; job0's failed cancel does not spare job1
    assert str(raised.value) == (
        "HF Jobs launch of rank 2 failed: quota exceeded; cancelled the 2 replicas already launched"
    )
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert api.cancelled == ["job1"]


def test_hf_jobs_flavors_and_rendezvous_check() -> None:
    ex = HFJobsExecutor("img", api=FakeHfApi())
    assert ex.flavor(None) == "cpu-upgrade" and ex.flavor("t4") == "t4-small"
    assert ex.flavor("a10g-largex2") == "a10g-largex2"
    with pytest.raises(ValueError, match="unknown gpu 'V100'"):
        ex.flavor("V100")
    with pytest.raises(ValueError, match="hf://"):
        ex.launch_replicas(1, "m", {"rendezvous_uri": "file:///tmp/x"})
