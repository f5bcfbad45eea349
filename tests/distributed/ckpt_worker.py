"""Worker of the sharded-checkpoint tests: one rank trains the tiny model one step, writes a
sharded checkpoint, loads it into a freshly built, freshly sharded policy and optimizer, and
saves what both hold (gathered whole) for the test to compare."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def _whole(policy, optimizer) -> dict:
    """Every trainable parameter and its AdamW moments, gathered whole, by name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    params = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in policy.named_parameters()
        if p.requires_grad
    }
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    optim = get_optimizer_state_dict(policy, optimizer, options=options)
    return {"params": params, "optim": optim.get("state", {})}  # rank 0 holds it


def _trained_policy(lora: bool, ranks):
    from dp_worker import build_policy, samples

    from composer_replication.distributed import shard_policy, sum_counts_over_ranks
    from composer_replication.distributed.fsdp import GatheredWeights
    from composer_replication.samples.wire import pack_samples
    from composer_replication.training.step import train_step

    policy = build_policy(lora)
    shard_policy(policy)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    rl_only = samples()[:7]  # the rl samples
    batches = pack_samples(ranks.share(rl_only), max_tokens=64, split=None)
    with GatheredWeights(policy).accumulating():
        train_step(policy, batches, count_reducer=sum_counts_over_ranks)
    optimizer.step()
    return policy, optimizer


def run(rank: int, world: int, port: int, lora: bool, out: str) -> None:
    from dp_worker import build_policy

    from composer_replication.distributed import join_local_group, shard_policy
    from composer_replication.training.checkpoint import CheckpointManager

    torch.set_num_threads(1)
    ranks = join_local_group(rank, world, port, torch.device("cpu"), timeout_s=60)
    policy, optimizer = _trained_policy(lora, ranks)
    manager = CheckpointManager(out, keep_last=1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    torch.manual_seed(100 + rank)  # each rank's RNG, to come back after loading
    expected_draw = torch.rand(3)
    torch.manual_seed(100 + rank)
    manager.save(1, model=policy, optimizer=optimizer, scheduler=scheduler, extra={}, ranks=ranks)
    saved = _whole(policy, optimizer)
    # a fresh policy and optimizer, sharded the same way, loaded from the checkpoint
    fresh = build_policy(lora)
    for p in fresh.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p)  # nothing of the trained state left
    shard_policy(fresh)
    fresh_optimizer = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad])
    torch.manual_seed(0)
    state = manager.load(
        manager.latest(), model=fresh, optimizer=fresh_optimizer, scheduler=None, ranks=ranks
    )
    assert state["step"] == 1
    draw = torch.rand(3)
    loaded = _whole(fresh, fresh_optimizer)
    if rank == 0:
        torch.save({"saved": saved, "loaded": loaded}, f"{out}/whole.pt")
    torch.save({"expected": expected_draw, "got": draw}, f"{out}/rng.rank{rank}.pt")
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    rank, world, port = (int(v) for v in sys.argv[1:4])
    run(rank, world, port, sys.argv[4] == "lora", sys.argv[5])
