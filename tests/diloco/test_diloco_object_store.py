"""ObjectStoreAllReduce: exact means over file://, plain paths and S3 (moto), atomic writes,
timeouts, garbage collection, and the boundary errors."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from composer_replication.diloco.serverless.object_store import ObjectStoreAllReduce


def run_ranks(world: int, fn: Callable[[int], Any]) -> list[Any]:
    """Run ``fn(rank)`` in one thread per rank; re-raise the first error."""
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


def reference_mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    return (torch.stack([t.double() for t in tensors]).sum(0) / len(tensors)).float()


def make_tensors(world: int, shape: tuple[int, ...] = (37, 5)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(shape, generator=g) * (r + 1) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_mean_is_exact_over_file_uri(tmp_path: Path, world: int) -> None:
    inputs = make_tensors(world)
    expected = reference_mean(inputs)
    uri = (tmp_path / "rdv").as_uri()

    def rank_fn(rank: int) -> torch.Tensor:
        store = ObjectStoreAllReduce(uri, rank, world, poll_interval_s=0.01, timeout_s=30)
        t = inputs[rank].clone()
        out = store.allreduce(t, name="g")
        assert out is t  # in place, and returned
        assert store.round_id == 1
        return t

    results = run_ranks(world, rank_fn)
    for r in results:
        assert torch.equal(r, expected)
    assert (tmp_path / "rdv" / "round_000000" / "rank_0000.pt").exists()


def test_plain_path_and_several_rounds(tmp_path: Path) -> None:
    world, rounds = 2, 3
    inputs = [[torch.full((4,), float(10 * k + r)) for r in range(world)] for k in range(rounds)]

    def rank_fn(rank: int) -> list[torch.Tensor]:
        store = ObjectStoreAllReduce(str(tmp_path / "p"), rank, world, poll_interval_s=0.01)
        return [store.allreduce(inputs[k][rank].clone()) for k in range(rounds)]

    for per_rank in run_ranks(world, rank_fn):
        for k in range(rounds):
            assert torch.equal(per_rank[k], torch.full((4,), 10 * k + 0.5))


def test_mean_is_exact_over_s3(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    bucket, options = s3_bucket
    world = 3
    inputs = make_tensors(world, (64,))
    expected = reference_mean(inputs)

    def rank_fn(rank: int) -> torch.Tensor:
        store = ObjectStoreAllReduce(
            f"{bucket}/run-1", rank, world, poll_interval_s=0.05, storage_options=options
        )
        return store.allreduce(inputs[rank].clone(), name="pg")

    for r in run_ranks(world, rank_fn):
        assert torch.equal(r, expected)
    import boto3

    s3 = boto3.client("s3", endpoint_url=options["client_kwargs"]["endpoint_url"])
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket[5:])["Contents"])
    # only final names remain: the temporary upload names were moved away
    assert keys == [f"run-1/round_000000/rank_{r:04d}.pt" for r in range(world)]


def test_rounds_are_garbage_collected_keeping_the_last_two(tmp_path: Path) -> None:
    world, rounds = 3, 6
    uri = str(tmp_path / "gc")

    def rank_fn(rank: int) -> ObjectStoreAllReduce:
        store = ObjectStoreAllReduce(uri, rank, world, poll_interval_s=0.01)
        for _ in range(rounds):
            store.allreduce(torch.ones(3) * rank)
        return store

    stores = run_ranks(world, rank_fn)
    assert stores[0].rounds_present() == [rounds - 2, rounds - 1]
    # each rank deleted exactly its own files of rounds 0..rounds-3
    assert [s.stats.objects_deleted for s in stores] == [rounds - 2] * world
    assert sorted(p.name for p in (tmp_path / "gc").iterdir()) == ["round_000004", "round_000005"]


def test_gc_on_s3_keeps_last_two_rounds(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    bucket, options = s3_bucket

    def rank_fn(rank: int) -> ObjectStoreAllReduce:
        store = ObjectStoreAllReduce(
            f"{bucket}/gc", rank, 2, poll_interval_s=0.02, storage_options=options
        )
        for _ in range(4):
            store.allreduce(torch.ones(2))
        return store

    stores = run_ranks(2, rank_fn)
    assert stores[1].rounds_present() == [2, 3]


def test_late_peer_times_out_naming_the_missing_rank(tmp_path: Path) -> None:
    store = ObjectStoreAllReduce(str(tmp_path), 0, 3, timeout_s=0.3, poll_interval_s=0.05)
    with pytest.raises(TimeoutError, match=r"ranks \[1, 2\] of 3"):
        store.allreduce(torch.zeros(2))


def test_readers_ignore_temporary_uploads(tmp_path: Path) -> None:
    """A peer whose upload is still under its temporary name does not count as present."""
    (tmp_path / "round_000000").mkdir()
    (tmp_path / "round_000000" / ".tmp-rank_0001-abc.pt").write_bytes(b"half a tens")
    store = ObjectStoreAllReduce(str(tmp_path), 0, 2, timeout_s=0.3, poll_interval_s=0.05)
    with pytest.raises(TimeoutError, match=r"ranks \[1\]"):
        store.allreduce(torch.zeros(2))


def test_mismatched_peer_tensor_is_an_error(tmp_path: Path) -> None:
    shapes = [(3,), (4,)]

    def rank_fn(rank: int) -> None:
        store = ObjectStoreAllReduce(str(tmp_path), rank, 2, poll_interval_s=0.01, timeout_s=10)
        store.allreduce(torch.zeros(shapes[rank]), name="g")

    with pytest.raises(ValueError, match="same order"):
        run_ranks(2, rank_fn)


def test_broadcast_copies_rank_zero(tmp_path: Path) -> None:
    def rank_fn(rank: int) -> torch.Tensor:
        store = ObjectStoreAllReduce(str(tmp_path), rank, 3, poll_interval_s=0.01)
        return store.broadcast(torch.full((5,), float(rank + 1)), name="init")

    for t in run_ranks(3, rank_fn):
        assert torch.equal(t, torch.ones(5))


def test_a_previous_runs_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "round_000000").mkdir()
    (tmp_path / "round_000000" / "rank_0000.pt").write_bytes(b"old")
    store = ObjectStoreAllReduce(str(tmp_path), 0, 1)
    with pytest.raises(RuntimeError, match="fresh prefix"):
        store.allreduce(torch.zeros(1))
    resumed = ObjectStoreAllReduce(str(tmp_path), 0, 1, round_id=1)
    assert torch.equal(resumed.allreduce(torch.ones(1)), torch.ones(1))
    assert resumed.round_id == 2


def test_a_view_uploads_only_its_own_elements(tmp_path: Path) -> None:
    base = torch.arange(10_000, dtype=torch.float32)
    store = ObjectStoreAllReduce(str(tmp_path), 0, 1)
    store.allreduce(base[:10])
    assert store.stats.bytes_written < 4_000  # not the 40 kB base storage


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": 2, "world_size": 2}, r"rank must be an int in \[0, 2\)"),
        ({"rank": -1, "world_size": 2}, "rank must be"),
        ({"rank": 0, "world_size": 0}, "world_size must be"),
        ({"rank": 0, "world_size": 1, "timeout_s": 0}, "timeout_s"),
    ],
)
def test_bad_arguments_raise_value_error(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ObjectStoreAllReduce(str(tmp_path), **kwargs)


def test_integer_tensors_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="floating-point"):
        ObjectStoreAllReduce(str(tmp_path), 0, 1).allreduce(torch.ones(2, dtype=torch.int64))


@pytest.mark.parametrize(("uri", "package"), [("gs://b/x", "gcsfs"), ("az://c/x", "adlfs")])
def test_missing_backend_names_the_package(uri: str, package: str) -> None:
    import importlib.util

    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed")
    with pytest.raises(RuntimeError, match=f"pip install {package}"):
        ObjectStoreAllReduce(uri, 0, 1)


def test_unknown_protocol_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="fsspec knows no protocol"):
        ObjectStoreAllReduce("nosuchproto://x", 0, 1)
