"""DiLoCo vs per-step gradient all-reduce (DDP): bytes, all-reduce wall time, loss.

1. Bytes per inner step and replica for SmolLM2-135M (134,515,008 fp32 parameters): DiLoCo
   syncs once every H inner steps through ObjectStoreAllReduce (each replica uploads its
   pseudo-gradient once and downloads the N-1 others); DDP all-reduces gradients every
   step (ring: each replica sends and receives 2(N-1)/N of the gradient). The object-store
   bytes are counted in a REAL round (payload bytes this rank wrote + read, serialisation
   included) and scaled to SmolLM2's size.
2. Wall time of one object-store all-reduce of SmolLM2-sized pseudo-gradients across 4
   local replicas (threads) on file://, and on S3 served by moto (smaller tensor, scaled).
3. Loss after a fixed budget of inner steps: 2 DiLoCo replicas (H=10) vs 1 replica that
   sees the same total data (twice the batch), tiny Llama on a next-token task.

Run: ``.venv/bin/python benchmarks/diloco.py [--quick]``.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from composer_replication.diloco.integration import ObjectStoreDiLoCo
from composer_replication.diloco.serverless.object_store import ObjectStoreAllReduce
from composer_replication.model.loading import tiny_model

SMOLLM2_PARAMS = 134_515_008


def run_threads(world: int, fn: Callable[[int], Any]) -> list[Any]:
    out: list[Any] = [None] * world
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def allreduce_round(
    uri: str, world: int, numel: int, options: dict[str, Any] | None = None
) -> tuple[float, list[Any]]:
    """One all-reduce of a ``numel`` fp32 tensor per replica; (max wall s, per-rank stats)."""
    tensors = [torch.full((numel,), float(r)) for r in range(world)]

    def rank_fn(rank: int) -> tuple[float, Any]:
        store = ObjectStoreAllReduce(
            uri, rank, world, poll_interval_s=0.02, storage_options=options
        )
        t0 = time.perf_counter()
        store.allreduce(tensors[rank], name="pseudo_gradient")
        return time.perf_counter() - t0, store.stats

    results = run_threads(world, rank_fn)
    assert all(torch.all(t == (world - 1) / 2) for t in tensors)
    return max(r[0] for r in results), [r[1] for r in results]


def bytes_section(world: int, numel: int) -> float:
    print(
        f"\n== 1. bytes per inner step and replica, SmolLM2 ({SMOLLM2_PARAMS:,} params), N={world}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        _, stats = allreduce_round(f"file://{tmp}/bytes", world, numel)
    moved = stats[0].bytes_written + stats[0].bytes_read
    per_param = moved / numel  # bytes crossing the store per parameter per round
    print(
        f"measured round ({numel:,} params): rank 0 wrote {stats[0].bytes_written:,} B, read "
        f"{stats[0].bytes_read:,} B = {per_param:.4f} B/param (raw fp32 upload+downloads: "
        f"{4 * world:.1f})"
    )
    diloco_round = per_param * SMOLLM2_PARAMS
    ddp_step = 2 * 2 * (world - 1) / world * 4 * SMOLLM2_PARAMS  # ring: send + receive
    print(f"DDP (ring all-reduce every step): {ddp_step / 1e9:.3f} GB per step")
    for h in (10, 50, 100):
        per_step = diloco_round / h
        print(
            f"DiLoCo H={h:3d}: {per_step / 1e9:.4f} GB per inner step "
            f"-> DDP / DiLoCo = {ddp_step / per_step:.1f}x"
        )
    return diloco_round


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def walltime_section(world: int, file_numel: int, s3_numel: int) -> None:
    print(f"\n== 2. one object-store all-reduce, {world} local replicas (threads)")
    with tempfile.TemporaryDirectory() as tmp:
        wall, _ = allreduce_round(f"file://{tmp}/wall", world, file_numel)
    scale = SMOLLM2_PARAMS / file_numel
    note = "" if scale == 1 else f" (measured at {file_numel:,} params, x{scale:.1f} scaled)"
    print(f"file:// : {wall * scale:.2f} s for {SMOLLM2_PARAMS * 4 / 1e6:.0f} MB per replica{note}")

    import logging
    import os

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto logs every request
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            os.environ[k] = "testing"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
            Bucket="bench"
        )
        options = {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        }
        wall, _ = allreduce_round("s3://bench/wall", world, s3_numel, options)
    finally:
        server.stop()
    scale = SMOLLM2_PARAMS / s3_numel
    print(
        f"moto S3: {wall:.2f} s at {s3_numel:,} params ({s3_numel * 4 / 1e6:.0f} MB) -> "
        f"{wall * scale:.1f} s scaled linearly to SmolLM2 (moto keeps objects in one Python "
        "process; a real S3 bucket parallelises)"
    )


def next_token_batch(perm: torch.Tensor, batch: int, length: int, g: torch.Generator):
    """Sequences that follow a fixed permutation: x[t+1] = perm[x[t]]."""
    x = torch.empty(batch, length, dtype=torch.long)
    x[:, 0] = torch.randint(0, perm.numel(), (batch,), generator=g)
    for t in range(1, length):
        x[:, t] = perm[x[:, t - 1]]
    return x


def loss_section(steps: int, h: int, batch: int) -> None:
    print(f"\n== 3. loss after {steps} inner steps (tiny Llama, next-token permutation task)")
    vocab, length = 64, 16
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    eval_ids = next_token_batch(perm, 64, length, torch.Generator().manual_seed(99))

    def build() -> torch.nn.Module:
        return tiny_model(seed=0, vocab_size=vocab, hidden_size=32, intermediate_size=64)

    def eval_loss(model: torch.nn.Module) -> float:
        with torch.no_grad():
            return float(model(input_ids=eval_ids, labels=eval_ids).loss)

    def train(
        model: torch.nn.Module, seed: int, bsz: int, sync: Any = None, steps_override: int = 0
    ) -> None:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps_override or steps):
            ids = next_token_batch(perm, bsz, length, g)
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            if sync is not None:
                sync.after_inner_step()

    train(build(), seed=0, bsz=batch)  # warm-up: first-call costs stay out of the timings
    single = build()
    t0 = time.perf_counter()
    train(single, seed=1, bsz=2 * batch)
    t_single = time.perf_counter() - t0
    longer = build()
    t0 = time.perf_counter()
    train(longer, seed=1, bsz=batch, steps_override=2 * steps)
    t_longer = time.perf_counter() - t0
    models = [build(), build()]
    with tempfile.TemporaryDirectory() as tmp:

        def replica(rank: int) -> None:
            store = ObjectStoreAllReduce(f"{tmp}/loss", rank, 2, poll_interval_s=0.005)
            train(
                models[rank],
                seed=10 + rank,
                bsz=batch,
                sync=ObjectStoreDiLoCo(models[rank], store, sync_every=h),
            )

        t0 = time.perf_counter()
        run_threads(2, replica)
        t_diloco = time.perf_counter() - t0
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
    base, dl = eval_loss(build()), eval_loss(models[0])
    one, two = eval_loss(single), eval_loss(longer)
    print("(all three see the same total data; held-out loss)")
    print(f"initial                                   : {base:.4f}")
    print(
        f"1 replica, batch {2 * batch} x {steps} steps            : {one:.4f}  ({t_single:.1f} s)"
    )
    print(
        f"1 replica, batch {batch} x {2 * steps} steps            : {two:.4f}  ({t_longer:.1f} s)"
    )
    print(f"2 DiLoCo replicas (H={h}), batch {batch} x {steps} each: {dl:.4f}  ({t_diloco:.1f} s)")
    print(
        f"DiLoCo / 1-replica-2x-batch loss ratio: {dl / one:.3f}; / 1-replica-2x-steps: {dl / two:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small tensors, short training")
    ns = parser.parse_args()
    world = 4
    file_numel = 8_000_000 if ns.quick else SMOLLM2_PARAMS
    bytes_section(world, 1_000_000)
    walltime_section(world, file_numel, 4_000_000 if ns.quick else 16_000_000)
    loss_section(steps=60 if ns.quick else 200, h=10, batch=8)


if __name__ == "__main__":
    main()
