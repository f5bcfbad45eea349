"""Worker of the replica-group DiLoCo test: shard ``shard`` of ``shards`` of DiLoCo replica
``replica`` of ``replicas``. The replica's policy (tiny model, FSDP2-sharded over its
``shards`` ranks) takes two scripted inner updates, each followed by an outer step through a
file:// object store; the rank saves the whole parameters it ends with."""

from __future__ import annotations

import sys

import torch


def inner_update(policy, replica: int, step: int) -> None:
    """A different, deterministic change of every trainable weight on each replica."""
    gen = torch.Generator().manual_seed(1000 * replica + step)
    with torch.no_grad():
        for param in policy.parameters():
            if not param.requires_grad:
                continue
            delta = 0.01 * torch.randn(param.shape, generator=gen)
            if hasattr(param, "device_mesh"):  # this rank's part of the same change
                from torch.distributed.tensor import distribute_tensor

                delta = distribute_tensor(delta, param.device_mesh, param.placements)
            param.add_(delta)


def run(replica: int, replicas: int, shard: int, shards: int, port: int, store: str, out: str):
    from composer_replication.diloco.integration import ObjectStoreDiLoCo, shard_rendezvous
    from composer_replication.diloco.serverless.object_store import ObjectStoreAllReduce
    from composer_replication.model.loading import tiny_model

    torch.set_num_threads(1)
    policy = tiny_model(seed=replica)  # replicas start apart: the initial broadcast aligns them
    if shards > 1:
        from composer_replication.distributed import join_local_group, shard_policy

        join_local_group(shard, shards, port, torch.device("cpu"), timeout_s=120)
        shard_policy(policy)
    all_reduce = ObjectStoreAllReduce(
        shard_rendezvous(store), replica, replicas, timeout_s=120, poll_interval_s=0.02
    )
    diloco = ObjectStoreDiLoCo(policy, all_reduce, sync_every=1)
    for step in range(2):
        inner_update(policy, replica, step)
        assert diloco.after_inner_step()
    whole = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in policy.named_parameters()
    }
    if shard == 0:
        torch.save(whole, out)
    if shards > 1:  # both ranks done with the group before either tears its end down
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    replica, replicas, shard, shards, port = (int(v) for v in sys.argv[1:6])
    run(replica, replicas, shard, shards, port, sys.argv[6], sys.argv[7])
