"""All-reduce through an object store: replicas that share no network meet in a bucket.

Each call to ``ObjectStoreAllReduce.allreduce`` is one *round*. Rank ``k`` of round ``r``:

1. writes its tensor to ``<uri>/round_<r:06d>/rank_<k:04d>.pt`` ATOMICALLY: the payload goes
   up in one write under a temporary name (``.tmp-rank_<k:04d>-<hex>.pt``: one PUT on S3,
   or a multipart upload above s3fs's 50 MB block, which S3 also exposes only once whole)
   and is then renamed (local disk) or server-side copied (S3, GCS) to the final name.
   Readers only ever open final names, so nobody sees a half-written tensor;
2. polls one listing of the round's folder until all ``world_size`` final names exist
   (``TimeoutError`` after ``timeout_s``, naming the missing ranks);
3. reads the peers' tensors (its own comes from memory), sums all of them in rank order
   in float64 and writes ``sum / world_size`` back into the tensor IN PLACE. The float64
   sum of a few float32 values is exact, so every rank gets the same, correctly rounded
   mean, bit for bit;
4. garbage-collects (below) and moves on to round ``r + 1``.

Garbage collection, safe without any coordination: a rank writes round ``r`` only after
it has read every file of round ``r - 1``. So seeing all files of round ``r`` proves that
every rank is done reading round ``r - 1`` and everything before it. After completing
round ``r``, rank ``k`` deletes only ITS OWN objects of round ``r - 2`` (its final file and
any temporary file a crash left behind): one deleter per object, never a file another
rank may still read, and the bucket keeps the last two rounds (the latest for late
readers and debugging, one more as margin). On a local disk the emptied round folder is
removed by whichever rank empties it last. A rank that died never deletes its files:
bounded, and visible for post-mortems.

Use a fresh prefix per run (the ``diloco launch`` command puts a run id in it): round
numbers restart at 0, and the first round refuses to overwrite this rank's file left by
another run.
"""

from __future__ import annotations

import contextlib
import io
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

# fsspec protocol -> the package that implements it (what to install when it is missing)
_BACKEND_PACKAGES = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "hf": "huggingface_hub",
}


def open_filesystem(uri: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """``(fsspec filesystem, root path)`` for ``uri``; a missing backend -> ``RuntimeError``."""
    import fsspec.core

    protocol = uri.split("://", 1)[0] if "://" in uri else "file"
    try:
        fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    except (ImportError, ValueError) as exc:
        package = _BACKEND_PACKAGES.get(protocol)
        if package is None and isinstance(exc, ValueError):
            raise ValueError(
                f"rendezvous URI {uri!r}: fsspec knows no protocol {protocol!r} ({exc}); use "
                "s3://, gs://, az://, hf://, file:// or a plain path"
            ) from exc
        raise RuntimeError(
            f"rendezvous URI {uri!r} needs the fsspec backend for {protocol}://, which is not "
            f"installed ({exc}); install it with: pip install {package or protocol}"
        ) from exc
    return fs, root.rstrip("/")


def _is_local(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol or "local" in protocol


@dataclass
class TransferStats:
    """Bytes and objects this rank moved through the store (payloads only)."""

    rounds: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    objects_written: int = 0
    objects_read: int = 0
    objects_deleted: int = 0


class ObjectStoreAllReduce:
    """Average one tensor per round across ``world_size`` replicas through ``uri``.

    ``uri``: ``s3://bucket/prefix``, ``gs://``, ``az://``, ``hf://``, ``file://`` or a plain
    path (any fsspec URL whose backend is installed). ``round_id``: the first round to use
    (``None`` -> 0; pass the round to resume at after a restart). ``storage_options`` go to
    the fsspec filesystem (e.g. ``{"client_kwargs": {"endpoint_url": ...}}`` for S3-compatible
    stores); ``fs`` injects a ready filesystem instead.
    """

    def __init__(
        self,
        uri: str,
        rank: int,
        world_size: int,
        *,
        round_id: int | None = None,
        timeout_s: float = 1800.0,
        poll_interval_s: float = 1.0,
        storage_options: dict[str, Any] | None = None,
        fs: Any = None,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(
                f"rank must be an int in [0, {world_size}) for world_size={world_size}, "
                f"got {rank!r}"
            )
        if round_id is not None and round_id < 0:
            raise ValueError(f"round_id must be >= 0 or None, got {round_id}")
        if timeout_s <= 0 or poll_interval_s <= 0:
            raise ValueError(
                f"timeout_s and poll_interval_s must be > 0, got {timeout_s} and {poll_interval_s}"
            )
        self.uri = uri
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.poll_interval_s = poll_interval_s
        if fs is None:
            self.fs, self.root = open_filesystem(uri, storage_options)
        else:
            self.fs, self.root = fs, uri.split("://", 1)[-1].rstrip("/")
        self._local = _is_local(self.fs)
        self._round = round_id or 0
        # only a fresh start (round_id=None) checks for a previous run's files
        self._check_fresh = round_id is None
        self.stats = TransferStats()

    @property
    def round_id(self) -> int:
        """The round the next ``allreduce`` call will use."""
        return self._round

    # ------------------------------------------------------------------ names

    def round_dir(self, round_id: int) -> str:
        return f"{self.root}/round_{round_id:06d}"

    def rank_path(self, round_id: int, rank: int) -> str:
        return f"{self.round_dir(round_id)}/rank_{rank:04d}.pt"

    # ------------------------------------------------------------------ the round

    def allreduce(self, tensor: torch.Tensor, *, name: str | None = None) -> torch.Tensor:
        """Average ``tensor`` (any shape, floating dtype) over all ranks, in place.

        ``name`` labels what is reduced; peers that reduce a tensor with another name,
        shape or dtype in the same round make it raise ``ValueError`` (a desynchronised
        schedule), instead of silently averaging unrelated numbers.
        """
        if not tensor.is_floating_point():
            raise ValueError(
                f"allreduce averages floating-point tensors, got dtype {tensor.dtype}; "
                "cast to float32 first"
            )
        round_id = self._round
        if self._check_fresh and self.fs.exists(self.rank_path(round_id, self.rank)):
            raise RuntimeError(
                f"{self.rank_path(round_id, self.rank)} already exists: another run used the "
                f"rendezvous prefix {self.uri!r}; use a fresh prefix or pass round_id to resume"
            )
        self._check_fresh = False
        header = {"name": name, "shape": list(tensor.shape), "dtype": str(tensor.dtype)}
        self._write(round_id, tensor, header)
        ranks = self._wait_for_peers(round_id)
        total = torch.zeros(tensor.shape, dtype=torch.float64)
        for peer in ranks:
            if peer == self.rank:
                total += tensor.detach().to("cpu", torch.float64)
                continue
            peer_header, peer_tensor = self._read(round_id, peer)
            if peer_header != header:
                raise ValueError(
                    f"round {round_id}: rank {peer} reduced {peer_header} but rank {self.rank} "
                    f"reduced {header}; every rank must call allreduce in the same order"
                )
            total += peer_tensor.to(torch.float64)
        total /= self.world_size
        with torch.no_grad():
            tensor.copy_(total.to(tensor.dtype))
        self.stats.rounds += 1
        self._round = round_id + 1
        self._collect_garbage(round_id)
        return tensor

    def broadcast(
        self, tensor: torch.Tensor, *, src: int = 0, name: str | None = None
    ) -> torch.Tensor:
        """Copy rank ``src``'s ``tensor`` into every rank's ``tensor`` in place (one round).

        Every rank still writes a file (non-sources an empty marker) so that the round keeps
        the "all files present = everyone finished the previous round" proof GC relies on.
        """
        if not 0 <= src < self.world_size:
            raise ValueError(f"src must be in [0, {self.world_size}), got {src}")
        round_id = self._round
        self._check_fresh = False
        header = {"name": name, "shape": list(tensor.shape), "dtype": str(tensor.dtype)}
        payload = tensor if self.rank == src else torch.empty(0, dtype=tensor.dtype)
        self._write(round_id, payload, header)
        self._wait_for_peers(round_id)
        if self.rank != src:
            peer_header, peer_tensor = self._read(round_id, src)
            if peer_header != header:
                raise ValueError(
                    f"round {round_id}: rank {src} broadcast {peer_header} but rank "
                    f"{self.rank} expected {header}; every rank must call in the same order"
                )
            with torch.no_grad():
                tensor.copy_(peer_tensor)
        self.stats.rounds += 1
        self._round = round_id + 1
        self._collect_garbage(round_id)
        return tensor

    def _write(self, round_id: int, tensor: torch.Tensor, header: dict[str, Any]) -> None:
        payload = tensor.detach().cpu()
        if payload.untyped_storage().nbytes() != payload.numel() * payload.element_size():
            payload = payload.clone()  # a view would save its whole base storage
        buffer = io.BytesIO()
        torch.save({"header": header, "tensor": payload}, buffer)
        data = buffer.getvalue()
        final = self.rank_path(round_id, self.rank)
        tmp = f"{self.round_dir(round_id)}/.tmp-rank_{self.rank:04d}-{uuid.uuid4().hex[:12]}.pt"
        if self._local:
            self.fs.makedirs(self.round_dir(round_id), exist_ok=True)
        self.fs.pipe_file(tmp, data)  # one write (one PUT) of the whole payload
        self.fs.mv(tmp, final)  # rename locally; server-side copy + delete on object stores
        self.stats.bytes_written += len(data)
        self.stats.objects_written += 1

    def _wait_for_peers(self, round_id: int) -> list[int]:
        expected = {f"rank_{r:04d}.pt": r for r in range(self.world_size)}
        deadline = time.monotonic() + self.timeout_s
        directory = self.round_dir(round_id)
        while True:
            present = self._listing(directory) & expected.keys()
            if len(present) == self.world_size:
                return sorted(expected.values())
            if time.monotonic() >= deadline:
                missing = sorted(expected[n] for n in expected.keys() - present)
                raise TimeoutError(
                    f"round {round_id} at {self.uri!r}: ranks {missing} of {self.world_size} did "
                    f"not write within timeout_s={self.timeout_s}; check that those replicas "
                    "are alive and use this rendezvous URI, or raise timeout_s"
                )
            time.sleep(min(self.poll_interval_s, max(0.0, deadline - time.monotonic())))

    def _listing(self, directory: str) -> set[str]:
        self.fs.invalidate_cache(directory)  # fsspec caches listings; a poll must see news
        try:
            entries = self.fs.ls(directory, detail=False)
        except FileNotFoundError:
            return set()
        return {str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries}

    def _read(self, round_id: int, rank: int) -> tuple[dict[str, Any], torch.Tensor]:
        data = self.fs.cat_file(self.rank_path(round_id, rank))
        self.stats.bytes_read += len(data)
        self.stats.objects_read += 1
        obj = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        return obj["header"], obj["tensor"]

    def _collect_garbage(self, completed: int) -> None:
        """Delete this rank's own objects of round ``completed - 2`` (see the module doc)."""
        old = completed - 2
        if old < 0:
            return
        directory = self.round_dir(old)
        own = (f"rank_{self.rank:04d}.pt", f".tmp-rank_{self.rank:04d}-")
        names = [n for n in self._listing(directory) if n == own[0] or n.startswith(own[1])]
        for name in names:
            try:
                self.fs.rm_file(f"{directory}/{name}")
                self.stats.objects_deleted += 1
            except FileNotFoundError:
                pass
        if self._local:
            # succeeds only for the rank that empties it last
            with contextlib.suppress(OSError):
                self.fs.rmdir(directory)

    def rounds_present(self) -> list[int]:
        """Round numbers that still have objects under ``uri`` (for inspection and tests)."""
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        rounds = []
        for entry in entries:
            name = str(entry).rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("round_") and name[6:].isdigit() and self._listing(str(entry)):
                rounds.append(int(name[6:]))
        return sorted(rounds)
